// low_latency.cu: the low-latency (decode) path on NVSHMEM symmetric memory, or on a CUDA-IPC buffer inside one node
// (transport/ll.cuh says how the two builds differ).
//
//   dispatch<kUseFP8, TopkT, kMaxTopk>
//                              every token -> once to each rank owning one of its experts ([my rank][token] of
//                              that rank's recv area); per expert its count (epoch << 32 | count); per (token,
//                              top-k slot) an 8-byte index entry (expert, my rank, slot) -> epoch << 32 | token,
//                              released after the message (the row's only signal); receive: every block reads all
//                              counts and copies an even share of all rows into the packed outputs, each as soon
//                              as its entry carries the epoch
//   combine<TopkT, kMaxTopk>   owner's top-k + weights -> every rank; per (token, rank) one partial sum of that
//                              rank's weighted expert rows (fp32, 24 bits or, as the owner asks, bf16 on the
//                              wire) -> the owner, flag per token (sent by a flagger warp); receive: sum of
//                              partials. One launch splits its blocks into an expert side and an owner side (its
//                              own partials first, then the sums) that run at the same time
//   clean_low_latency_buffer   zero both signal regions between two NVSHMEM barriers (NVSHMEM build only; the
//                              library cleans on the host with timed barriers instead;
//                              tests/gpu/low_latency/test_nvshmem.py uses this one as its probe of the NVSHMEM
//                              device link and barriers)
//   ll_carve_probe             writes LowLatencyLayout's sizes (a GPU test compares them with config.py)
//
// Shape of both kernels: one block per SM (512 threads each; grid <= the SM
// count, so every block is resident and blocks may wait for each other without a grid barrier). `phases` selects
// SEND (1), RECV (2) or both: return_recv_hook launches SEND, the hook launches RECV.
//
// Slots are deterministic: (token t, slot k) for expert e gets slot
// #{(t', k') before (t, k) in row-major order with topk_idx[t', k'] == e}, computed from a shared-memory
// histogram of topk_idx (each block builds the counts of the rows before its first token, then advances
// it token by token; topk_idx itself is copied into shared memory at the kernel's start when it fits:
// stage_topk). Rows of a local expert are therefore ordered (source rank, token, k) exactly as cupy_ep/reference.py
// says. The dispatch also writes them into the handle's topk_slots, and the combine finds its
// rows by them (the owner sends each entry's slot with its expert in the meta), so it counts nothing.
//
// Dispatch send: per token t, warp 0 finds the distinct destination ranks of t (the owners of its valid experts:
// no slots needed) while the other warps' loads of x are in flight; then every thread casts its part of the row and
// stores the bytes straight from registers into recv [my rank][t] of each destination reachable by stores (~1 copy
// per rank instead of one per expert: ~4x fewer bytes at top-8 of 256 on 2 ranks). The block's first token goes
// out before the histograms. Warp 0 then finds t's slots and, after a block barrier (and the puts of destinations
// without an NVLink mapping, from this rank's send slot), each kept (t, k)'s lane releases at system scope and
// writes its index entry index[e % L][my rank][slot] = epoch << 32 | t on the expert's rank. The counts
// (min(hist_all[e], M), known from the histogram) go out right after the histograms, so no signal waits for the
// slowest block. The message's 16-byte header is unused (padding).
// Epochs: a dispatch's epoch is 1 + the dispatches on its buffer whose receive phase finished (kept in the
// workspace, the same on every rank as all ranks make the same calls). Counts and index entries left by
// older dispatches carry older epochs (the combine's signals and data do not overlap them;
// clean_low_latency_buffer zeroes the regions when the layout changes), so they are never taken for this call's,
// and nobody needs to consume them.
// Dispatch receive (dispatch_recv): every block reads all counts of this rank and their prefix over (local
// expert, source), then takes rows [b * N / G, (b + 1) * N / G) of all N rows in (expert, source, slot) order:
// the warps take (row, part) units and copy each as soon as the row's index entry carries the epoch
// (copy_rows_as_ready).
//
// Peers reachable by loads/stores (peer_bases[r] != 0: nvshmem_ptr on the host, or every peer with the CUDA-IPC
// transport) get direct NVLink stores; the others get ll_put_warp (message rows, each warp's followed by ll_quiet
// before the block barrier that precedes the entries) / ll_put_longlong (index entries) / ll_put_int (combine
// flags): NVSHMEM puts (transport/ll.cuh; the build with -DCUPY_EP_NVSHMEM).
//
// Combine signals: the meta flag arrives as W, K and T + 1 (meta_flag_value; W: the owner's wire format) and the
// token flags as 1, so 0 means "not arrived".
// Every one of them (the dispatch's counts and index entries carry epochs instead) is read in
// that call and zeroed right after by its waiter (consumed on
// read; a combine meta flag, which every block reads, by the last of them): the buffer is
// clean again when the call's receive phase is done, with no clearing pass and nothing for the senders to wait
// for (also under graph replay). The next write to that signal is by the call after next on the same buffer,
// and a peer gets there only after this rank signalled it in the next call, i.e. after this call's receive
// phase finished (the kernels are stream-ordered; a hook must run before the next low-latency call, which
// event.RecvHooks enforces).
//
// Shrink mode (Buffer(enable_shrink=True)): shrink_mask [R] int32 (device memory, 1 = masked; null otherwise; the
// same array as DeviceCtx::shrink_mask) is this rank's view of the failed ranks. Each launch reads it at its start
// (stage_masked); a peer masked then is neither sent to (the dispatch treats the top-k entries of its experts as not
// selected: no message, count or index entry, slot -1; the combine sends it no meta and no partials) nor waited for
// (its counts read as 0, its partials as absent, its meta as never coming). A wait for a peer that runs past the
// timeout masks it (wait_until<true>) and the launch goes on as if the peer had sent nothing from then on: no
// record, no abort. The combine's expert side serves the owners whose meta is in first (next_ready_owner), so a
// dead owner delays no live one (whose partials another rank waits for with the same timeout).
// A masked peer may still be alive and write into this rank's buffer: only into the areas of its own rank (its
// messages, counts, index entries, meta, partials and flags), which nothing reads while it is masked. Those, and
// the readers' counts of its meta flag, are in an undefined state once it has been masked, so a rank that takes
// part again must be cleaned first: unmask it everywhere, then clean_low_latency_buffer on every rank that takes
// part (it zeroes both buffers and the workspace after every such rank drained its device). A peer that fails
// after its counts arrived leaves that call's rows from it undefined (recv_count includes them).
#include "low_latency/common.cuh"
#include "low_latency/dispatch.cuh"
#include "low_latency/combine.cuh"

namespace ep {

using namespace low_latency;

// Outputs: packed_recv_x [L][R*M][H] (e4m3 bytes or bf16), packed_recv_scales [L][S][R*M] float32 or
// [L][S/4][R*M] int32 (UE8M0), packed_recv_count [L], src_info [L][R*M], layout_range [L][R] int64,
// cumulative_stats [L] or null, wait_stats [R] or null (add_wait_cost). x [T][H] bf16, topk_idx [T][K];
// topk_slots [T][K] int32 (out, written by the send phase): each entry's slot, -1 = not sent. rank, num_ranks
// (combine's too): the DeviceCtx's, passed by value: loading them from ctx sat on the prologue's critical path
// (~0.25 us); ctx is read only by the waits and failure reports,
// off that path. shrink_mask: ctx's, likewise (null without shrink mode).
template <bool kUseFP8, typename TopkT, int kMaxTopk = kLLDefaultTopkBound>
__global__ void __launch_bounds__(kLLThreads, 1)
    dispatch(void* packed_recv_x, void* packed_recv_scales, int* packed_recv_count, int* packed_recv_src_info,
             long long* packed_recv_layout_range, int* cumulative_stats, long long* wait_stats, const int4* x,
             const TopkT* topk_idx, int* topk_slots, int num_tokens, int num_topk, int round_scale, int use_ue8m0,
             void* base, const unsigned long long* peer_bases, int buffer_idx, int max_tokens, int hidden,
             int num_experts, int rank, int num_ranks, int* workspace, const int* shrink_mask, int phases,
             long long* stamps, const DeviceCtx* ctx) {
    __shared__ int hists[2 * kLLMaxExperts];  // send: the two histograms; receive: the counts' prefix
    __shared__ alignas(16) unsigned char topk_stage[kTopkStageBytes];  // send: topk_idx (stage_topk)
    __shared__ DispatchShared<kMaxTopk> sh;
    __shared__ DispatchRecvShared rs;
    const LowLatencyLayout L(max_tokens, hidden, num_ranks, num_experts);
    char* b = static_cast<char*>(base);
    if (threadIdx.x == 0) init_recv_shared(rs);
    if (!(phases & kPhaseSend)) stage_masked(shrink_mask, num_ranks, sh.masked);  // (else stage_send_shared)
    __syncthreads();
    if (phases & kPhaseSend)
        dispatch_send<kUseFP8>(x, topk_idx, topk_slots, num_tokens, num_topk, round_scale != 0, b, peer_bases, L, rank,
                               buffer_idx, workspace, shrink_mask, ctx, hists, hists + kLLMaxExperts,
                               reinterpret_cast<TopkT*>(topk_stage), sh, stamps);
    if (phases & kPhaseRecv)
        dispatch_recv<kUseFP8>(packed_recv_x, packed_recv_scales, packed_recv_count, packed_recv_src_info,
                               packed_recv_layout_range, cumulative_stats, wait_stats, use_ue8m0 != 0, b, L, buffer_idx,
                               workspace, sh.masked, shrink_mask, ctx, hists, rs, stamps);
}

// combined_x [T][H] bf16; x [L][R*M][H] bf16 (unused with zero_copy: the rows are in the send buffer);
// layout_range [L][R] and topk_slots [T][K] int32 from the dispatch handle; topk_idx [T][K] (the dispatch's),
// topk_weights [T][K] float32; wait_stats [R] or null (add_wait_cost); wire: the Wire of this rank's tokens'
// partials (bf16_partials / use_logfmt; the peers learn it from the meta flag).
template <typename TopkT, int kMaxTopk = kLLDefaultTopkBound>
__global__ void __launch_bounds__(kLLCombineThreads, 1)
    combine(int4* combined_x, const int4* x, const long long* layout_range, const TopkT* topk_idx,
            const int* topk_slots, const float* topk_weights, long long* wait_stats, int num_tokens, int num_topk,
            int zero_copy, int wire, void* base, const unsigned long long* peer_bases, int buffer_idx, int max_tokens,
            int hidden, int num_experts, int rank, int num_ranks, int* workspace, const int* shrink_mask, int phases,
            long long* stamps, const DeviceCtx* ctx) {
    __shared__ int begin[kLLMaxExperts];              // stage_range_begins: the rows of one owner in each local expert
    extern __shared__ __align__(16) int4 ll_stage[];  // partial_sums' slots (combine_stage_bytes)
    __shared__ CombineShared<kMaxTopk> sh;
    const LowLatencyLayout L(max_tokens, hidden, num_ranks, num_experts);
    char* b = static_cast<char*>(base);
    const OwnEntries<TopkT> own{topk_idx, topk_slots, num_experts};
    if (threadIdx.x == 0) sh.failed = 0;
    stage_masked(shrink_mask, num_ranks, sh.masked);
    // Here, not in combine_send: with one rank the split below leaves no expert-side block, and a combine that
    // did not record its buffer made the next dispatch report a reuse (the LL tests at one rank).
    if (phases & kPhaseSend) check_buffer_alternates(workspace, buffer_idx, ctx, kKernelLowLatencyCombine);
    __syncthreads();
    const bool own_in_recv = (phases & kPhaseSend) && (phases & kPhaseRecv);
    if (own_in_recv && gridDim.x >= 2) {
        // One launch, both phases: the blocks split into an expert side ((A) and (B): the meta, the remote owners'
        // partials) and an owner side ((C): the own partials, then the sums), which run at the same time, so the
        // owner's own work overlaps the partials' NVLink traffic instead of following it. The owner side gets 1/R
        // of the blocks (its own partials are 1/R of all partials); it only waits once its own work is done.
        const int owner_blocks = max(1, (int)gridDim.x / num_ranks), expert_blocks = gridDim.x - owner_blocks;
        if ((int)blockIdx.x < expert_blocks) {
            combine_send(x, zero_copy != 0, layout_range, own, topk_weights, num_tokens, num_topk, wire, b, peer_bases,
                         L, rank, buffer_idx, workspace, shrink_mask, ctx, begin, ll_stage, sh, true,
                         Blocks{(int)blockIdx.x, expert_blocks}, stamps);
        } else {
            stamp(stamps, kStampSendStart);  // (the block's start: phase_breakdown's origin is the earliest)
            combine_recv_as(wire == kWireLogFmt, combined_x, x, zero_copy != 0, layout_range, own, topk_weights,
                            num_tokens, num_topk, wire, b, L, rank, buffer_idx, shrink_mask, ctx, begin, ll_stage, sh,
                            true, Blocks{(int)blockIdx.x - expert_blocks, owner_blocks}, wait_stats, stamps);
        }
        return;
    }
    const Blocks all{(int)blockIdx.x, (int)gridDim.x};
    if (phases & kPhaseSend)
        combine_send(x, zero_copy != 0, layout_range, own, topk_weights, num_tokens, num_topk, wire, b, peer_bases, L,
                     rank, buffer_idx, workspace, shrink_mask, ctx, begin, ll_stage, sh, own_in_recv, all, stamps);
    __syncthreads();
    if ((phases & kPhaseRecv) && !sh.failed)  // uniform; a send phase that timed out stops here
        combine_recv_as(wire == kWireLogFmt, combined_x, x, zero_copy != 0, layout_range, own, topk_weights, num_tokens,
                        num_topk, wire, b, L, rank, buffer_idx, shrink_mask, ctx, begin, ll_stage, sh, own_in_recv, all,
                        wait_stats, stamps);
}

// ---------------------------------------------------------------------------------------------------
// cleaning and the carve probe
// ---------------------------------------------------------------------------------------------------
#ifdef CUPY_EP_NVSHMEM
__global__ void clean_low_latency_buffer(int* signals0, int num_signals0, int* signals1, int num_signals1) {
    ll_barrier_all_block();
    for (int i = threadIdx.x; i < num_signals0; i += blockDim.x) signals0[i] = 0;
    for (int i = threadIdx.x; i < num_signals1; i += blockDim.x) signals1[i] = 0;
    ll_barrier_all_block();
}
#endif

// out: signal, send, recv, total bytes, the offsets of sig1, send0, recv0, the dispatch's index table and the
// combine's meta inside a recv region, the signal ints, the combine's area inside a recv region
// (config.low_latency_layout).
__global__ void ll_carve_probe(int max_tokens, int hidden, int num_ranks, int num_experts, long long* out) {
    const LowLatencyLayout L(max_tokens, hidden, num_ranks, num_experts);
    out[0] = L.signal_bytes;
    out[1] = L.send_bytes;
    out[2] = L.recv_bytes;
    out[3] = L.total_bytes;
    out[4] = L.signal_offset(1);
    out[5] = L.send_offset(0);
    out[6] = L.recv_offset(0);
    out[7] = L.index_offset;
    out[8] = L.meta_offset;
    out[9] = L.signal_ints;
    out[10] = L.combine_offset;
}

}  // namespace ep
