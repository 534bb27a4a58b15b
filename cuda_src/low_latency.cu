// low_latency.cu: the low-latency (decode) path on NVSHMEM symmetric memory, or on a CUDA-IPC buffer inside one node
// (ll_transport.cuh says how the two builds differ).
//
//   dispatch<kUseFP8, TopkT>   every token -> once to each rank owning one of its experts ([my rank][token] of
//                              that rank's recv area); per expert its count (epoch << 32 | count); per (token,
//                              top-k slot) an 8-byte index entry (expert, my rank, slot) -> epoch << 32 | token,
//                              released after the message (the row's only signal); receive: every block reads all
//                              counts and copies an even share of all rows into the packed outputs, each as soon
//                              as its entry carries the epoch
//   combine<TopkT>             owner's top-k + weights -> every rank; per (token, rank) one partial sum of that
//                              rank's weighted expert rows (fp32, 24 bits or, as the owner asks, bf16 on the
//                              wire) -> the owner, flag per token (sent by a flagger warp); receive: sum of
//                              partials. One launch splits its blocks into an expert side and an owner side (its
//                              own partials first, then the sums) that run at the same time
//   clean_low_latency_buffer   zero both signal regions between two NVSHMEM barriers (NVSHMEM build only; the
//                              library cleans on the host with timed barriers instead; tests/gpu/test_nvshmem.py
//                              uses this one as its probe of the NVSHMEM device link and barriers)
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
// flags): NVSHMEM puts (ll_transport.cuh; the build with -DCUPY_EP_NVSHMEM).
//
// Combine signals: the meta flag arrives as W << 28 | K << 24 | T + 1 (W: the owner wants bf16 partials) and the
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
#include "common.cuh"
#include "buffer.cuh"
#include "ll_transport.cuh"

namespace ep {

// The dispatch runs 512 threads per block: against 1024 its kernel ends ~1 us earlier and a 0-token call costs ~1 us
// less. A token's row takes two passes of the block (TokenLoads holds both).
constexpr int kLLThreads = 512;
constexpr int kLLWarps = kLLThreads / kWarpSize;
// The combine runs 512 threads per block: 128 registers each (its owner loop spills at 64), and its token rows
// (H/8 columns) take two passes of the block.
constexpr int kLLCombineThreads = 512;
constexpr int kLLMaxExperts = 4096;  // mirrors config.LL_MAX_EXPERTS (two shared-memory histograms)
constexpr int kLLMaxRanks = 64;      // mirrors config.LL_MAX_RANKS
constexpr int kPhaseSend = 1, kPhaseRecv = 2;
// workspace (int32, zeroed once by the host): kWsLastSend = 1 + the buffer index of this rank's previous send
// phase (0 = none yet); kWsEpoch + i: the dispatches on buffer i whose receive phase finished (a dispatch's epoch
// is that + 1: its counts and index entries carry it); kWsRecvDone: blocks of the running dispatch receive
// phase that finished (the last one advances the epoch and resets it); from kWsMetaReaders per owner rank the
// blocks that have read its combine meta flag (the last one zeroes the flag and the count)
constexpr int kWsLastSend = 2, kWsEpoch = 4, kWsRecvDone = 6, kWsMetaReaders = 32;

// Optional phase stamps (profiling; built only with -DCUPY_EP_LL_STAMPS=1, cuda_low_latency.STAMPS_OPTION, and
// then written where stamps != nullptr): per block kLLStamps int64 %globaltimer values, written by thread 0 (most
// right after a block-wide barrier, so they mark when the whole block got there). Without the option the stamping
// code compiles away: its branches and barriers take registers from the kernels' common paths.
#ifdef CUPY_EP_LL_STAMPS
constexpr bool kStampsBuilt = true;
#else
constexpr bool kStampsBuilt = false;
#endif
// What each marks, per kernel (cupy_ep/bench_ll.py's report says the same):
//   dispatch: routed = the last token's destinations known; prepared = histograms built; encoded = its bytes
//             stored; written = thread 0 past its index entry (released); recv_prepared = the counts read and
//             prefixed; recv_first_data = the block's first row in.
//             The receive side's first row, finer (at one rank it comes 1.7 us after the prefix
//             although every entry is released before it): recv_copy_start = the warp of the block's first unit
//             starts waiting for its row (past the per-expert outputs); recv_row_seen = its lane 0 has the row's
//             index entry (recv_first_data follows after the warp's shuffle and __syncwarp). send_first_stored =
//             thread 0's part of the block's first message stored (before the histograms).
//   combine:  prepared = the own tokens' partials flagged (hook mode); routed = the first remote owner's meta in;
//             encoded = the last partial row stored; written = its flag sent; recv_prepared = the block's own
//             partials computed (one launch); recv_first_data = the first token's partials in.
constexpr int kLLStamps = 13;
enum LLStamp : int {
    kStampSendStart = 0, kStampSendPrepared = 1, kStampSendRouted = 2, kStampSendEncoded = 3,
    kStampSendWritten = 4, kStampSendEnd = 5, kStampRecvStart = 6, kStampRecvPrepared = 7,
    kStampRecvFirstData = 8, kStampRecvEnd = 9, kStampSendFirstStored = 10, kStampRecvCopyStart = 11,
    kStampRecvRowSeen = 12,
};
__device__ __forceinline__ void stamp_by(long long* stamps, int which, bool writer) {
    if (kStampsBuilt && stamps != nullptr && writer) stamps[blockIdx.x * kLLStamps + which] = (long long)globaltimer_ns();
}
__device__ __forceinline__ void stamp(long long* stamps, int which) { stamp_by(stamps, which, threadIdx.x == 0); }
// A block barrier only when stamping (the condition is uniform over the block).
__device__ __forceinline__ void stamp_after_barrier(long long* stamps, int which) {
    if (!kStampsBuilt || stamps == nullptr) return;
    __syncthreads();
    stamp(stamps, which);
}

// Wait-time statistics (the API's dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats, [R] int64, as
// DeepEP's): the SM clock cycles (clock64) a receiver spent waiting for each source rank's data, added into
// stats[source] by a reduction whose result nobody waits for. With stats == nullptr (the default) no clock is read.
// The dispatch counts each (local expert, source) count's wait once (block 0's counters); the combine each token's
// partials flag (per block and source, summed in a register first).
__device__ __forceinline__ long long wait_clock(const long long* stats) { return stats != nullptr ? clock64() : 0; }
__device__ __forceinline__ long long waited_since(const long long* stats, long long since) {
    return stats != nullptr ? clock64() - since : 0;
}
__device__ __forceinline__ void add_wait_cost(long long* stats, int source, long long cycles) {
    if (stats != nullptr && cycles > 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(stats + source), static_cast<unsigned long long>(cycles));
}

// Two floats -> two e4m3 bytes (lo at the lower address), round to nearest even, saturating to +-448.
__device__ __forceinline__ unsigned int cvt_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// DeepEP's calculate_fp8_scales (mirrors reference.fp8_scales).
__device__ __forceinline__ void fp8_scales(float amax, bool round_scale, float& scale, float& scale_inv) {
    const float ratio = amax * (1.0f / 448.0f);
    if (!round_scale) {
        scale = 448.0f / amax;
        scale_inv = ratio;
        return;
    }
    const unsigned bits = __float_as_uint(ratio);
    const int exponent = (int)((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0u);
    scale_inv = __int_as_float((exponent + 127) << 23);
    scale = __int_as_float((127 - exponent) << 23);
}

// One int to PE `pe`'s symmetric buffer at `offset`, ordered after everything this thread has observed.
__device__ __forceinline__ void send_signal(char* base, const unsigned long long* peer_bases, int pe,
                                            long long offset, int value) {
    char* direct = reinterpret_cast<char*>(peer_bases[pe]);
    if (direct != nullptr) {
        st_release_sys(reinterpret_cast<int*>(direct + offset), value);
    } else {
        fence_acq_rel_sys();
        ll_put_int(reinterpret_cast<int*>(base + offset), value, pe);
    }
}

// log2 of a power of two, at compile time.
__host__ __device__ constexpr int log2_exact(int v) { return v > 1 ? 1 + log2_exact(v >> 1) : 0; }

// x / d and x % d (x >= 0) for a divisor fixed per call (the rank count, the experts per rank), by shifts when d
// is a power of two (the usual case: 2, 4, 8 ranks; 256 experts over them) and by division otherwise; `shift` =
// log2(d) or -1 (a uniform branch). An integer division is a dependent chain of ~15 instructions (~70 cycles), and
// the dispatch's bookkeeping on its critical path had several.
struct FastDiv {
    int d, shift;
    __device__ __forceinline__ explicit FastDiv(int d_) : d(d_), shift((d_ & (d_ - 1)) == 0 ? __ffs(d_) - 1 : -1) {}
    __device__ __forceinline__ int div(int x) const { return shift >= 0 ? x >> shift : x / d; }
    __device__ __forceinline__ int mod(int x) const { return shift >= 0 ? x & (d - 1) : x % d; }
};

// Shrink mode: warp 0 stages the ranks masked when the launch starts into `masked` (bit r = rank r; 0 without
// shrink mode), read by the block after a barrier.
__device__ __forceinline__ void stage_masked(const int* shrink_mask, int num_ranks, unsigned long long& masked) {
    if (warp_id() != 0) return;
    const int lane = lane_id();
    if (shrink_mask == nullptr) {
        if (lane == 0) masked = 0;
        return;
    }
    const unsigned lo = __ballot_sync(0xffffffffu, lane < num_ranks && ld_volatile(shrink_mask + lane) != 0);
    const unsigned hi = __ballot_sync(0xffffffffu, lane + 32 < num_ranks && ld_volatile(shrink_mask + lane + 32) != 0);
    if (lane == 0) masked = (unsigned long long)hi << 32 | lo;
}
// Bit r of a set of ranks (`masked`, a combine's owners to serve, ...).
__device__ __forceinline__ bool has_rank(unsigned long long ranks, int r) { return (ranks >> r) & 1ull; }
// A failed wait_until<true> for `peer`: true when shrink mode masked the peer (go on without it), false for a failure
// that stops the buffer.
__device__ __forceinline__ bool peer_dropped(const int* shrink_mask, int peer) {
    return shrink_mask != nullptr && ld_volatile(shrink_mask + peer) != 0;
}

// ---------------------------------------------------------------------------------------------------
// Deterministic slots: hist[e] = top-k entries selecting e in the rows before the current token.
// ---------------------------------------------------------------------------------------------------
// Dispatch send, at the kernel's start: both histograms zeroed (visible after the first block barrier, which
// build_histograms' counting follows).
__device__ __forceinline__ void zero_histograms(int num_experts, int* hist, int* hist_all) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = hist_all[e] = 0;
}

// Dispatch send, at the kernel's start: the call's whole topk_idx copied into shared memory by cp.async (no
// registers held while it travels) when it fits in kTopkStageBytes (128 tokens x top-8 of int64 does), so that the
// histograms and the slots read it there after the first message instead of paying a global load round trip each
// on the critical path. Returns where to read topk_idx from: the stage, or topk_idx itself. Each thread waits
// for its copies (cp_async_wait_all) before the first block barrier, which makes them visible.
constexpr int kTopkStageBytes = 8192;
template <typename TopkT>
__device__ __forceinline__ const TopkT* stage_topk(const TopkT* topk_idx, int count, TopkT* stage) {
    if ((long long)count * (long long)sizeof(TopkT) > kTopkStageBytes) return topk_idx;
    for (int f = threadIdx.x; f < count; f += blockDim.x) cp_async_small<sizeof(TopkT)>(stage + f, topk_idx + f);
    return stage;
}

// Counts into the zeroed histograms (zero_histograms; a block barrier since): hist[e] over the rows before
// first_token, hist_all[e] over all rows. Ends with a block barrier.
template <typename TopkT>
__device__ void build_histograms(const TopkT* topk_idx, int num_tokens, int num_topk, int num_experts,
                                 int first_token, int* hist, int* hist_all) {
    const int prefix = min(first_token, num_tokens) * num_topk;
    for (int f = threadIdx.x; f < num_tokens * num_topk; f += blockDim.x) {
        const long long e = (long long)topk_idx[f];
        if (e < 0 || e >= num_experts) continue;
        if (f < prefix) atomicAdd(&hist[e], 1);
        atomicAdd(&hist_all[e], 1);
    }
    __syncthreads();
}

template <typename TopkT>
__device__ void advance_histogram(const TopkT* topk_idx, int from_token, int to_token, int num_topk,
                                  int num_experts, int* hist) {
    for (int f = from_token * num_topk + (int)threadIdx.x; f < to_token * num_topk; f += blockDim.x) {
        const long long e = (long long)topk_idx[f];
        if (e >= 0 && e < num_experts) atomicAdd(&hist[e], 1);
    }
}

// Threads k < K: the expert and slot of (t, k) (slot -1: no expert, an expert of a masked rank, or past the M slots
// of the expert), also into the handle's topk_slots [T][K] (the combine finds the rows by them instead of counting
// again).
template <typename TopkT>
__device__ void token_slots(const TopkT* topk_idx, int t, int num_topk, int num_experts, int num_local,
                            unsigned long long masked, int max_tokens, const int* hist, int* s_expert, int* s_slot,
                            int* topk_slots) {
    const int k = threadIdx.x;
    if (k >= num_topk) return;
    const TopkT* row = topk_idx + (long long)t * num_topk;
    const long long e = (long long)row[k];
    int slot = -1;
    if (e >= 0 && e < num_experts && (masked == 0 || !has_rank(masked, FastDiv(num_local).div((int)e)))) {
        int before = 0;
        for (int j = 0; j < k; ++j) before += (long long)row[j] == e;
        slot = hist[e] + before;
        if (slot >= max_tokens) slot = -1;
    }
    s_expert[k] = (int)e;
    s_slot[k] = slot;
    topk_slots[(long long)t * num_topk + k] = slot;
}

// What one block knows about its current token (dispatch send; written by warp 0, read after a block barrier).
struct DispatchShared {
    int expert[kLLMaxTopk];      // token_slots: global expert of entry k
    int slot[kLLMaxTopk];        // token_slots: its slot, -1 = not kept
    int put_dest[kLLMaxTopk];    // destination ranks reached by NVSHMEM puts (no NVLink mapping), num_put of them
    char* target[kLLMaxTopk + 1];  // where the message bytes are stored: each mapped destination's recv slot
                                   // (num_store of them), then this rank's send slot when num_put > 0 (the puts'
                                   // symmetric source)
    int num_target, num_store, num_put;
    unsigned long long peer[kLLMaxRanks];  // peer_bases, staged by warp 0 at the start (no global load per use)
    unsigned long long masked;             // stage_masked, likewise (the receive phase reads it too)
    int epoch;                             // the call's epoch, staged likewise
};

// Dispatch, warp 0: the token's distinct destination ranks (owners of its valid experts, in the order of their
// first k; masked ranks left out) sorted into store targets and put destinations. They do not depend on the slots,
// so the message can go out before the histograms are built: a (t, k) past its expert's M slots is dropped by
// getting no index entry (its message may then travel for nothing; as T <= M only a row naming one expert twice
// can do that).
// `e`: lane k's expert (TokenLoads::expert); `recv_msg`: the message's offset in a recv region; `send_msg`: this
// rank's send slot of the token.
__device__ __forceinline__ void token_targets(long long e, int num_experts, int num_local, long long recv_msg,
                                              char* send_msg, DispatchShared& sh) {
    if (warp_id() != 0) return;
    const int lane = lane_id();
    const bool valid = e >= 0 && e < num_experts;
    const int dst = valid ? FastDiv(num_local).div((int)e) : -1 - lane;  // lanes without an expert: a key of their own
    const unsigned same = __match_any_sync(0xffffffffu, dst);
    __syncwarp();  // sh.peer and sh.masked, staged by this warp (stage_send_shared)
    const bool first = valid && __ffs(same) - 1 == lane && !has_rank(sh.masked, dst);
    char* direct = first ? reinterpret_cast<char*>(sh.peer[dst]) : nullptr;
    const unsigned stores = __ballot_sync(0xffffffffu, first && direct != nullptr);
    const unsigned puts = __ballot_sync(0xffffffffu, first && direct == nullptr);
    const unsigned below = (1u << lane) - 1u;
    if (first && direct != nullptr) sh.target[__popc(stores & below)] = direct + recv_msg;
    if (first && direct == nullptr) sh.put_dest[__popc(puts & below)] = dst;
    if (lane == 0) {
        const int num_stores = __popc(stores), num_put = __popc(puts);
        if (num_put > 0) sh.target[num_stores] = send_msg;
        sh.num_target = num_stores + (num_put > 0);
        sh.num_store = num_stores;
        sh.num_put = num_put;
    }
}

// Dispatch, warp 0, once the message's stores are issued and a block barrier passed (and its puts complete): per
// kept (t, k) (slots from token_slots, in sh) its index entry on the expert's rank, epoch << 32 | t in one 8-byte
// store, each after a system-scope release by its lane (covering the block's message stores, ordered before it by
// the barrier). The entry is the row's only signal: a receiver that acquires it with the call's epoch may read the
// message. Entries of destinations without an NVLink mapping are NVSHMEM puts, after the message's puts completed.
__device__ __forceinline__ void send_index_entries(int t, int num_topk, char* base, const LowLatencyLayout& L,
                                                   long long recv, int rank, const DispatchShared& sh) {
    const int lane = lane_id();
    if (warp_id() != 0 || lane >= num_topk || sh.slot[lane] < 0) return;
    const FastDiv by_local(L.num_local);
    const int e = sh.expert[lane], pe = by_local.div(e);
    const long long offset = recv + L.dispatch_recv_index(by_local.mod(e), rank, sh.slot[lane]);
    const long long entry = ((long long)sh.epoch << 32) | (unsigned)t;
    char* direct = reinterpret_cast<char*>(sh.peer[pe]);
    if (direct != nullptr) {
        fence_acq_rel_sys();
        st_relaxed_sys(reinterpret_cast<long long*>(direct + offset), entry);
    } else {
        ll_put_longlong(reinterpret_cast<long long*>(base + offset), entry, pe);
    }
}

// Block 0, thread 0, at the start of a send phase: the buffers must alternate between send phases. The host
// alternates them per call, but a CUDA graph bakes the index in at capture, so a graph holding an odd number of
// low-latency calls replays two sends on one buffer in a row; stop the buffer loudly instead of letting the
// receivers read stale signals. (The peers make the same calls, so they stop as well.)
__device__ __forceinline__ void check_buffer_alternates(int* workspace, int buffer_idx, const DeviceCtx* ctx, int kernel) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int previous = workspace[kWsLastSend];  // written only here, by one thread per launch (stream order)
    if (previous == 1 + buffer_idx)
        report_failure(ctx, WaitSite{kernel, kRoleBufferReuse, -1, -1}, buffer_idx, buffer_idx ^ 1, -1, 0);
    workspace[kWsLastSend] = 1 + buffer_idx;
}

// The running dispatch's epoch on buffer `buffer_idx` (1 + the dispatches on it whose receive phase finished): the
// same in its send and receive launches and in every block, as only the last block to finish a receive phase
// advances it. Staged in shared memory by the send phase (stage_send_shared), read once by the receive phase.
__device__ __forceinline__ int dispatch_epoch(const int* workspace, int buffer_idx) {
    return ld_volatile(workspace + kWsEpoch + buffer_idx) + 1;
}

// ---------------------------------------------------------------------------------------------------
// dispatch
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ int dispatch_msg_int4(bool use_fp8, int hidden) {
    return use_fp8 ? (16 + hidden + hidden / 32) / 16 : (16 + 2 * hidden) / 16;
}

// A token's first loads, issued before anything waits on memory (they start its message's critical path):
// per thread x[t]'s int4 number threadIdx.x (zero past the row or the tokens), and in warp 0 lane k's expert
// topk_idx[t][k] (-1 for k >= K; token_targets reads it).
struct TokenLoads {
    int4 first, second;  // x[t][threadIdx.x], x[t][threadIdx.x + blockDim.x]
    long long expert;
};
template <typename TopkT>
__device__ __forceinline__ TokenLoads load_token(const int4* x, const TopkT* topk_idx, int t, int num_tokens,
                                                 int num_topk, int hidden_int4) {
    TokenLoads in{make_int4(0, 0, 0, 0), make_int4(0, 0, 0, 0), -1};
    if (t >= num_tokens) return in;
    if (warp_id() == 0 && lane_id() < num_topk) in.expert = (long long)topk_idx[(long long)t * num_topk + lane_id()];
    const int4* row = x + (long long)t * hidden_int4;
    if ((int)threadIdx.x < hidden_int4) in.first = ld_nc_v4(row + threadIdx.x);
    if ((int)(threadIdx.x + blockDim.x) < hidden_int4) in.second = ld_nc_v4(row + threadIdx.x + blockDim.x);
    return in;
}

// A token's message after its 16-byte header (unused): the FP8 bytes and
// float scales, or the BF16 row, element by element to emit(byte offset in the message, value) for value int4,
// uint2 or float. `in.first` / `in.second` are x_row[threadIdx.x] and x_row[threadIdx.x + blockDim.x] (loaded early
// by the caller, ahead of a barrier).
// hidden % 512 == 0 for FP8: whole warps iterate together, 16 lanes per 128-channel group.
template <bool kUseFP8, typename Emit>
__device__ __forceinline__ void encode_token(const TokenLoads& in, const int4* x_row, int hidden, bool round_scale,
                                             Emit emit) {
    const int hidden_int4 = hidden / 8;
    for (int i = threadIdx.x, j = 0; i < hidden_int4; i += blockDim.x, ++j) {
        const int4 v = j == 0 ? in.first : j == 1 ? in.second : ld_nc_v4(x_row + i);
        if constexpr (kUseFP8) {
            const unsigned w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
            float f[8];
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                f[2 * j] = bf16_lo(w[j]);
                f[2 * j + 1] = bf16_hi(w[j]);
                amax = fmaxf(amax, fmaxf(fabsf(f[2 * j]), fabsf(f[2 * j + 1])));
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            amax = fmaxf(amax, 1e-4f);
            float scale, scale_inv;
            fp8_scales(amax, round_scale, scale, scale_inv);
            uint2 out;
            out.x = cvt_e4m3x2(f[0] * scale, f[1] * scale) | (cvt_e4m3x2(f[2] * scale, f[3] * scale) << 16);
            out.y = cvt_e4m3x2(f[4] * scale, f[5] * scale) | (cvt_e4m3x2(f[6] * scale, f[7] * scale) << 16);
            emit(16 + 8LL * i, out);
            if ((i & 15) == 0) emit(16LL + hidden + 4LL * (i >> 4), scale_inv);
        } else {
            emit(16 + 16LL * i, v);
        }
    }
}

// The counts go out first (every block has them in hist_all): expert e's count from this rank is
// min(hist_all[e], M), at its owner's dispatch_count(e % L, rank) as epoch << 32 | count in one 8-byte store.
// They order nothing: a receiver waits for each row's index entry to carry the epoch too.
__device__ __forceinline__ void send_counts(const int* hist_all, char* base, const LowLatencyLayout& L,
                                            int buffer_idx, int rank, const DispatchShared& sh) {
    if (lane_id() != 0 || warp_id() == 0) return;  // (warp 0 goes on to the token's slots)
    const FastDiv by_local(L.num_local);
    for (int e = blockIdx.x + gridDim.x * (warp_id() - 1); e < L.num_experts; e += gridDim.x * (kLLWarps - 1)) {
        const int count = min(hist_all[e], L.num_max_tokens), pe = by_local.div(e);
        if (has_rank(sh.masked, pe)) continue;
        const long long offset = L.signal_offset(buffer_idx) + 8LL * L.dispatch_count(by_local.mod(e), rank);
        const long long value = ((long long)sh.epoch << 32) | (unsigned)count;
        char* direct = reinterpret_cast<char*>(sh.peer[pe]);
        if (direct != nullptr) st_relaxed_sys(reinterpret_cast<long long*>(direct + offset), value);
        else ll_put_longlong(reinterpret_cast<long long*>(base + offset), value, pe);
    }
}

// encode_token's emit in the dispatch: each value of the message to every target of the token (a functor, not a
// generic lambda: the NVRTC of CUDA 13.0 takes a generic lambda's call operator for host code unless the whole file
// is compiled with -default-device, which only the NVSHMEM build is).
struct StoreToTargets {
    char* const* target;  // DispatchShared::target
    int num_target;
    template <typename T>
    __device__ __forceinline__ void operator()(long long offset, T value) const {
        for (int j = 0; j < num_target; ++j) *reinterpret_cast<T*>(target[j] + offset) = value;
    }
};

// Dispatch, one token's message: its targets (warp 0), then every thread casts its part of the row and stores the
// bytes straight from registers into every mapped destination (and the send slot for puts). The stores are issued,
// not ordered: the caller's block barrier and the index entries' releases follow.
template <bool kUseFP8>
__device__ __forceinline__ void send_message(const int4* x, const TokenLoads& in, int t, bool round_scale,
                                             char* send, long long recv, const LowLatencyLayout& L,
                                             int rank, DispatchShared& sh, long long* stamps) {
    const int hidden_int4 = L.hidden / 8;
    // this thread's first x chunk is in flight while warp 0 works out where the token goes
    token_targets(in.expert, L.num_experts, L.num_local, recv + L.dispatch_recv_msg(rank, t),
                  send + (long long)t * L.msg_bytes, sh);
    __syncthreads();  // the targets are visible to the block
    stamp(stamps, kStampSendRouted);
    encode_token<kUseFP8>(in, x + (long long)t * hidden_int4, L.hidden, round_scale,
                          StoreToTargets{sh.target, sh.num_target});
}

// Dispatch, the destinations without an NVLink mapping: the message from this rank's send slot by NVSHMEM puts,
// the warps split evenly over them, each warp one part of the row after the 16-byte header (the entries follow
// once the puts are complete: each warp quiets its own). Kept out of line: only the put path calls it, and
// inlined its NVSHMEM code would take registers from the kernel's common path.
__device__ __noinline__ void put_message(char* base, const char* send_msg, long long recv_msg, int msg_int4,
                                         const DispatchShared& sh) {
    const int num_put = sh.num_put, warps_per_dest = kLLWarps / num_put, row_int4 = msg_int4 - 1;
    const int d = warp_id() / warps_per_dest, part = warp_id() - d * warps_per_dest;
    if (d >= num_put) return;
    const int part_int4 = (row_int4 + warps_per_dest - 1) / warps_per_dest;
    const int begin = 1 + part * part_int4, n = min(part_int4, msg_int4 - begin);
    if (n > 0)
        ll_put_warp(base + recv_msg + begin * 16LL, send_msg + begin * 16LL, (size_t)n * 16, sh.put_dest[d]);
    __syncwarp();
    if (lane_id() == 0) ll_quiet();
}

// Dispatch send, warp 0 first: peer_bases and the call's epoch into shared memory (token_targets reads them after
// a __syncwarp, everyone else after a block barrier): one global load each per block instead of one per use.
__device__ __forceinline__ void stage_send_shared(const unsigned long long* peer_bases, int num_ranks,
                                                  const int* workspace, int buffer_idx, const int* shrink_mask,
                                                  DispatchShared& sh) {
    if (warp_id() != 0) return;
    for (int r = lane_id(); r < num_ranks; r += kWarpSize) sh.peer[r] = peer_bases[r];
    if (lane_id() == 0) sh.epoch = dispatch_epoch(workspace, buffer_idx);
    stage_masked(shrink_mask, num_ranks, sh.masked);
}

// Dispatch send. The block's first token goes out before the histograms (its destinations do not depend on the
// slots); then per token its slots, one block barrier, and its index entries, each after a system-scope release.
template <bool kUseFP8, typename TopkT>
__device__ void dispatch_send(const int4* x, const TopkT* topk_idx, int* topk_slots, int num_tokens, int num_topk,
                              bool round_scale,
                              char* base, const unsigned long long* peer_bases, const LowLatencyLayout& L, int rank,
                              int buffer_idx, int* workspace, const int* shrink_mask, const DeviceCtx* ctx,
                              int* hist, int* hist_all, TopkT* topk_stage, DispatchShared& sh, long long* stamps) {
    const int E = L.num_experts, hidden_int4 = L.hidden / 8;
    stamp(stamps, kStampSendStart);
    // the first token's loads go out before warp 0's staging waits on its own loads (which would hold back warp
    // 0's share of them by a memory round trip), and the buffer check after its message is out
    const TokenLoads first = load_token(x, topk_idx, blockIdx.x, num_tokens, num_topk, hidden_int4);
    zero_histograms(E, hist, hist_all);
    const TopkT* idx = stage_topk(topk_idx, num_tokens * num_topk, topk_stage);
    stage_send_shared(peer_bases, L.num_ranks, workspace, buffer_idx, shrink_mask, sh);
    const long long recv = L.recv_offset(buffer_idx);  // (the send slot is recomputed where used: registers)
    cp_async_wait_all();  // this thread's part of the stage; the next block barrier publishes it and the zeroes
    if ((int)blockIdx.x < num_tokens)
        send_message<kUseFP8>(x, first, blockIdx.x, round_scale, base + L.send_offset(buffer_idx), recv, L, rank,
                              sh, stamps);
    else
        __syncthreads();  // (uniform) as send_message's first barrier
    stamp(stamps, kStampSendFirstStored);
    check_buffer_alternates(workspace, buffer_idx, ctx, kKernelLowLatencyDispatch);
    build_histograms(idx, num_tokens, num_topk, E, blockIdx.x, hist, hist_all);
    stamp(stamps, kStampSendPrepared);  // build_histograms ends with a block barrier
    send_counts(hist_all, base, L, buffer_idx, rank, sh);

    for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        if (t != (int)blockIdx.x)
            send_message<kUseFP8>(x, load_token(x, idx, t, num_tokens, num_topk, hidden_int4), t, round_scale,
                                  base + L.send_offset(buffer_idx), recv, L, rank, sh, stamps);
        if (warp_id() == 0)  // the slots of t's entries (hist: the rows before t)
            token_slots(idx, t, num_topk, E, L.num_local, sh.masked, L.num_max_tokens, hist, sh.expert, sh.slot,
                        topk_slots);
        __syncthreads();  // every store of the message is issued (bar.sync orders them before the entries'
                          // releases); the slots are visible
        stamp(stamps, kStampSendEncoded);
        if (sh.num_put > 0) {  // uniform
            put_message(base, base + L.send_offset(buffer_idx) + (long long)t * L.msg_bytes,
                        recv + L.dispatch_recv_msg(rank, t), dispatch_msg_int4(kUseFP8, L.hidden), sh);
            __syncthreads();  // every put of this token is complete
        }
        if (t + (int)gridDim.x < num_tokens) {  // the next token's slots count the rows before it (uniform)
            advance_histogram(idx, t, min(t + (int)gridDim.x, num_tokens), num_topk, E, hist);
            __syncthreads();  // hist is advanced (after the last token nobody reads hist: warp 0 read its slots
                              // before the barrier above, and the receive phase's prefix, in hist's space, is
                              // written by warps past that barrier)
        }
        // After the barrier, so that the other warps go on (to the next token's message, or after the last token to
        // the receive phase) while warp 0's releases wait for the NVLink stores (~2 us). Warp 0 itself writes the
        // slots it reads here (token_slots), and nobody else reads them.
        send_index_entries(t, num_topk, base, L, recv, rank, sh);
    }
    stamp(stamps, kStampSendWritten);  // thread 0 is past the last token's first index entry
    stamp(stamps, kStampSendEnd);
}

// Dispatch receive, shared memory (the counts' prefix over (local expert, source) pairs lives in hist's space: up
// to kLLMaxExperts + 1 ints).
struct DispatchRecvShared {
    int warp_sums[kLLWarps];  // scan_counts
    int failed;
    // The receive phase's counters (warps 1..; warp 0 may still be releasing the send phase's last index entries)
    // sync among themselves on `scan` and arrive once on `prefix_ready` when the prefix is written, which warp 0
    // waits for. mbarriers, not named barriers: racecheck miscounts a warp that skips a `bar.sync id, n`.
    unsigned long long scan, prefix_ready;
};

// Thread 0 at the kernel's start, before its first block barrier.
__device__ __forceinline__ void init_recv_shared(DispatchRecvShared& rs) {
    rs.failed = 0;
    mbarrier_init(&rs.scan, kLLThreads - kWarpSize);
    mbarrier_init(&rs.prefix_ready, kLLThreads - kWarpSize);
}

// The counters (warps 1.. of the receive phase): a[0..n) -> exclusive prefix sums, a[n] = the total
// (n < kLLMaxExperts + 1). Each counter scans a contiguous chunk; warp shuffles and one pass over the warp totals
// join them. `sync()` is their barrier; the last one is the caller's.
template <typename Sync>
__device__ __forceinline__ void scan_counts(int* a, int n, int* warp_sums, Sync sync) {
    constexpr int kThreads = kLLThreads - kWarpSize, kWarps = kLLWarps - 1;
    const int c = (int)threadIdx.x - kWarpSize, per = (n + kThreads - 1) / kThreads;
    const int lo = min(n, c * per), hi = min(n, lo + per), lane = lane_id(), warp = warp_id() - 1;
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += a[i];
    int inclusive = sum;
#pragma unroll
    for (int o = 1; o < kWarpSize; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
    }
    if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
    sync();
    if (warp == 0) {
        const int own = lane < kWarps ? warp_sums[lane] : 0;
        int w = own;
#pragma unroll
        for (int o = 1; o < kWarpSize; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += v;
        }
        if (lane < kWarps) warp_sums[lane] = w - own;  // exclusive over the warps
    }
    sync();
    int run = warp_sums[warp] + inclusive - sum;
    for (int i = lo; i < hi; ++i) {
        const int v = a[i];
        a[i] = run;
        run += v;
    }
    if (c == kThreads - 1) a[n] = run;  // its chunk is the last one (or empty at n)
}

// Largest i < n with prefix[i] <= row (row < prefix[n]): the (local expert, source) pair holding global row `row`,
// found by the whole warp (every lane calls it with the same row): each round the lanes test 32 evenly spaced
// candidates at once and keep the last one at or below the row, so n = 256 pairs take two rounds of one shared
// load per lane instead of eight dependent rounds of a binary search (the receive phase's bookkeeping before
// the first copy is a chain of dependent latencies, ~0.9 us at one rank).
__device__ __forceinline__ int warp_pair_of_row(const int* prefix, int n, int row) {
    int lo = 0, hi = n;  // the answer lies in [lo, hi), and prefix[lo] <= row
    while (hi - lo > 1) {
        const int step = (hi - lo + kWarpSize - 1) / kWarpSize;
        const int i = lo + lane_id() * step;
        const unsigned ok = __ballot_sync(0xffffffffu, i < hi && prefix[i] <= row);  // lanes 0..k: prefix ascends
        lo += (kWarpSize - 1 - __clz(ok)) * step;
        hi = min(hi, lo + step);
    }
    return lo;
}

// Every block: the counts of every (local expert e, source s) pair into prefix[e * R + s], waiting for each to carry
// the call's epoch (counts are never consumed, so any number of blocks may read them); then their prefix. Only the
// counters (warps 1..) do this: in a launch with both phases warp 0 is still releasing the send phase's last index
// entries (~1.6 us of system-scope fences), and the prefix should not wait for them. They sync on rs.scan and
// then arrive on rs.prefix_ready; warp 0 waits there (wait_for_prefix) before it reads the prefix or rs.failed.
// Shrink mode: a masked source's counts are 0, unread.
__device__ __forceinline__ void read_counts(const long long* counts, int n, int epoch, int* prefix,
                                            DispatchRecvShared& rs, const LowLatencyLayout& L,
                                            unsigned long long masked, const int* shrink_mask, const DeviceCtx* ctx,
                                            long long* wait_stats) {
    if (warp_id() == 0) return;
    for (int i = (int)threadIdx.x - kWarpSize; i < n; i += (int)blockDim.x - kWarpSize) {
        if (has_rank(masked, i % L.num_ranks)) {
            prefix[i] = 0;
            continue;
        }
        long long v = 0;
        const long long waiting_since = wait_clock(wait_stats);
        const bool ok = wait_until<true>(ctx, WaitSite{kKernelLowLatencyDispatch, kRoleReceiver, i / L.num_ranks,
                                                       i % L.num_ranks},
                                         [&] { return (int)((v = ld_volatile(counts + i)) >> 32) == epoch; },
                                         [&](long long& head, long long& tail, long long& expected) {
                                             head = v >> 32;
                                             tail = (int)(v & 0xffffffff);
                                             expected = epoch;
                                         });
        add_wait_cost(wait_stats, i % L.num_ranks, waited_since(wait_stats, waiting_since));
        prefix[i] = ok ? (int)(v & 0xffffffff) : 0;
        if (!ok && !peer_dropped(shrink_mask, i % L.num_ranks)) rs.failed = 1;
    }
    int phase = 0;
    const auto sync = [&] { group_mbarrier_sync(&rs.scan, phase); };
    sync();
    scan_counts(prefix, n, rs.warp_sums, sync);
    sync();
    mbarrier_arrive(&rs.prefix_ready);
}

// Warp 0 of the receive phase: the counters' prefix (and rs.failed) is written.
__device__ __forceinline__ void wait_for_prefix(DispatchRecvShared& rs) {
    if (warp_id() == 0) mbarrier_wait(&rs.prefix_ready, 0);
}

// One row of the global (local expert, source, slot) order, by lane 0 of a warp: wait until its index entry carries
// the call's epoch (older dispatches' entries carry older epochs; the combine's area does not overlap them),
// acquired at system scope: the sender released its message before writing the entry. Returns the source token,
// or -1 on a timeout (shrink mode: also once the source is masked).
__device__ __forceinline__ int wait_row(int row, int pair, int s, const int* prefix, const char* recv, int epoch,
                                        const LowLatencyLayout& L, const DeviceCtx* ctx) {
    const int e = pair / L.num_ranks;
    const long long* entry = reinterpret_cast<const long long*>(recv + L.dispatch_recv_index(e, s, row - prefix[pair]));
    long long v = 0;
    const bool ok = wait_until<true>(ctx, WaitSite{kKernelLowLatencyDispatch, kRoleReceiver, e, s},
                                     [&] { return (int)((v = ld_acquire_sys(entry)) >> 32) == epoch; },
                                     [&](long long& head, long long& tail, long long& expected) {
                                         head = v >> 32;
                                         tail = row - prefix[pair];
                                         expected = epoch;
                                     });
    return ok ? (int)(v & 0xffffffff) : -1;
}

// Rows [lo, hi) of the global (local expert, source, slot) order into the packed outputs, each copied as soon as
// it is in: the warps take units (row, part), a row's payload split over `parts` warps (so a block's few rows
// use all its warps); per unit lane 0 waits for the row (wait_row; the warp's other lanes are ordered after its
// acquire by __syncwarp), then the warp copies its part with kInFlight loads per lane in flight, part 0 also the
// row's scales and source index. No block barrier: a late row holds up only the warps that copy it. Returns false
// on a timeout (shrink mode: a row whose source got masked is skipped, left as it is).
template <bool kUseFP8>
__device__ __forceinline__ bool copy_rows_as_ready(int lo, int hi, const int* prefix, int n, const char* recv,
                                                   int epoch, void* packed_recv_x, void* packed_recv_scales,
                                                   int* packed_recv_src_info, bool use_ue8m0,
                                                   const LowLatencyLayout& L, const int* shrink_mask,
                                                   const DeviceCtx* ctx, long long* stamps) {
    constexpr int kInFlight = 8, kMaxParts = 8;  // 8 loads per lane: a unit (half a row at 512 threads) in one pass
    const int rows = hi - lo, R = L.num_ranks, rows_per_expert = R * L.num_max_tokens, lane = lane_id();
    if (rows <= 0) return true;
    // parts of a row per unit: the largest power of two p with rows * p <= kLLWarps (at most kMaxParts), so that a
    // unit's row and part are shifts of its index: no division on the way to the first copy.
    // log2 p = log2(kLLWarps) - ceil(log2(rows)), clamped to [0, log2(kMaxParts)].
    static_assert((kLLWarps & (kLLWarps - 1)) == 0 && (kMaxParts & (kMaxParts - 1)) == 0, "powers of two");
    constexpr int kWarpsLog2 = log2_exact(kLLWarps), kMaxPartsLog2 = log2_exact(kMaxParts);
    const int parts_log2 = max(0, min(kMaxPartsLog2, kWarpsLog2 - (32 - __clz(rows - 1))));
    const int parts = 1 << parts_log2;
    const int data_int4 = kUseFP8 ? L.hidden / 16 : L.hidden / 8;
    const int words = kUseFP8 ? (use_ue8m0 ? L.hidden / 512 : L.hidden / 128) : 0;  // scale words per row
    const int part_int4 = (data_int4 + parts - 1) >> parts_log2;
    const FastDiv by_rank(R);
    // warp 0 takes the block's last units: in a launch with both phases it comes from the send phase's releases
    for (int u = (warp_id() + kLLWarps - 1) % kLLWarps; u < rows * parts; u += kLLWarps) {
        const int j = u >> parts_log2, part = u & (parts - 1), row = lo + j;
        const int pair = warp_pair_of_row(prefix, n, row), s = by_rank.mod(pair), e = by_rank.div(pair);
        int token = 0;
        if (u == 0) stamp_by(stamps, kStampRecvCopyStart, lane == 0);
        if (lane == 0) token = wait_row(row, pair, s, prefix, recv, epoch, L, ctx);
        if (u == 0) stamp_by(stamps, kStampRecvRowSeen, lane == 0);
        token = __shfl_sync(0xffffffffu, token, 0);
        __syncwarp();  // the message's bytes are read after lane 0's acquire of its entry
        if (token < 0) {  // uniform over the warp
            if (peer_dropped(shrink_mask, s)) continue;
            return false;
        }
        if (u == 0) stamp_by(stamps, kStampRecvFirstData, lane == 0);  // the block's first row is in
        const int out_row = e * rows_per_expert + (row - prefix[e * R]);
        const char* msg = recv + L.dispatch_recv_msg(s, token);
        const int4* src = reinterpret_cast<const int4*>(msg + 16);
        int4* dst = reinterpret_cast<int4*>(packed_recv_x) + (long long)out_row * data_int4;
        const int begin = part * part_int4, end = min(data_int4, begin + part_int4);
        for (int i = begin + lane; i < end; i += kInFlight * kWarpSize) {
            int4 v[kInFlight];
#pragma unroll
            for (int q = 0; q < kInFlight; ++q)
                if (i + q * kWarpSize < end) v[q] = ld_ring_v4(src + i + q * kWarpSize);
#pragma unroll
            for (int q = 0; q < kInFlight; ++q)
                if (i + q * kWarpSize < end) dst[i + q * kWarpSize] = v[q];
        }
        if (part != 0) continue;
        for (int w = lane; w < words; w += kWarpSize) {  // column-major scales: [L][words][R*M]
            int value;
            if (use_ue8m0) {  // four float scales -> one word of their exponents
                const int4 f = ld_ring_v4(reinterpret_cast<const int4*>(msg + 16 + L.hidden) + w);
                const unsigned b[4] = {(unsigned)f.x, (unsigned)f.y, (unsigned)f.z, (unsigned)f.w};
                unsigned packed = 0;
#pragma unroll
                for (int q = 0; q < 4; ++q) packed |= ((b[q] >> 23) & 0xffu) << (8 * q);
                value = (int)packed;
            } else {
                value = ld_volatile(reinterpret_cast<const int*>(msg + 16 + L.hidden) + w);
            }
            reinterpret_cast<int*>(packed_recv_scales)[((long long)e * words + w) * rows_per_expert +
                                                       (out_row - e * rows_per_expert)] = value;
        }
        if (lane == 0) packed_recv_src_info[out_row] = token;
    }
    return true;
}

// Dispatch receive: every block reads all counts of this rank (they arrive early) and takes an even share of all
// the rows (local expert, source, slot order), whatever expert they belong to, so no block waits on a big
// expert while others idle; its warps copy each row as soon as it is in (copy_rows_as_ready). Blocks write the
// per-expert outputs (count, layout_range, stats) of experts blockIdx.x, blockIdx.x + gridDim.x, ...
template <bool kUseFP8>
__device__ void dispatch_recv(void* packed_recv_x, void* packed_recv_scales, int* packed_recv_count,
                              int* packed_recv_src_info, long long* packed_recv_layout_range, int* cumulative_stats,
                              long long* wait_stats, bool use_ue8m0, char* base, const LowLatencyLayout& L,
                              int buffer_idx, int* workspace, unsigned long long masked, const int* shrink_mask,
                              const DeviceCtx* ctx, int* prefix, DispatchRecvShared& rs, long long* stamps) {
    // No barrier first: prefix reuses hist, which the send phase last touched before its last barrier (warp 0 is
    // past it, releasing the last token's index entries: ~1.6 us of system-scope fences, which the counters'
    // reading and prefixing of the counts overlaps, and the copies of the rows that are in already).
    stamp(stamps, kStampRecvStart);
    const int R = L.num_ranks, n = L.num_local * R, epoch = dispatch_epoch(workspace, buffer_idx);
    const char* recv = base + L.recv_offset(buffer_idx);
    const long long* counts = reinterpret_cast<const long long*>(base + L.signal_offset(buffer_idx));
    read_counts(counts, n, epoch, prefix, rs, L, masked, shrink_mask, ctx,
                blockIdx.x == 0 ? wait_stats : nullptr);  // each pair once
    wait_for_prefix(rs);
    // Every thread of the block has read the epoch by now (the counters before arriving on prefix_ready, which
    // warp 0 waited for). Thread 0 takes the block's ticket now, and only looks at it at the end: the last block
    // to take one advances the epoch. At the end the atomic's round trip sat on the launch's tail (~0.6 us for a
    // kernel of this shape); here the copies hide it.
    const int ticket = threadIdx.x == 0 ? atomicAdd(workspace + kWsRecvDone, 1) : 0;
    if (!rs.failed) {
        stamp_by(stamps, kStampRecvPrepared, threadIdx.x == kWarpSize);  // a counter, past the counters' last sync
        // warp 0 only (it takes the block's last copy units): the other warps go straight on to their first copy
        for (int e = blockIdx.x; warp_id() == 0 && e < L.num_local; e += gridDim.x) {
            const int begin = prefix[e * R];
#pragma unroll 1
            for (int s = lane_id(); s < R; s += kWarpSize) {
                const int from = prefix[e * R + s];
                packed_recv_layout_range[(long long)e * R + s] = ((long long)(from - begin) << 32) | (prefix[e * R + s + 1] - from);
            }
            if (lane_id() == 0) {
                packed_recv_count[e] = prefix[e * R + R] - begin;
                if (cumulative_stats != nullptr) cumulative_stats[e] += prefix[e * R + R] - begin;
            }
        }
        const long long total = prefix[n];
        const int lo = (int)(total * blockIdx.x / gridDim.x), hi = (int)(total * (blockIdx.x + 1) / gridDim.x);
        if (!copy_rows_as_ready<kUseFP8>(lo, hi, prefix, n, recv, epoch, packed_recv_x, packed_recv_scales,
                                         packed_recv_src_info, use_ue8m0, L, shrink_mask, ctx, stamps))
            rs.failed = 1;
    }
    stamp_after_barrier(stamps, kStampRecvEnd);
    // The last block to take a ticket advances the buffer's epoch for its next dispatch (every block read it
    // before its ticket; the kernel boundary orders the write before the next launch). The stored count is
    // epoch - 1 (dispatch_epoch) and nothing else writes it during the launch, so the new one follows from the
    // epoch in hand: no load of it on the launch's last path (a round trip). After 2^32
    // dispatches the count wraps: it skips -1 (stored -2 -> 0), so that no epoch is 0, the value of zeroed memory.
    if (threadIdx.x == 0 && ticket == (int)gridDim.x - 1) {
        workspace[kWsRecvDone] = 0;
        workspace[kWsEpoch + buffer_idx] = epoch == -1 ? 0 : epoch;
    }
}

// Outputs: packed_recv_x [L][R*M][H] (e4m3 bytes or bf16), packed_recv_scales [L][S][R*M] float32 or
// [L][S/4][R*M] int32 (UE8M0), packed_recv_count [L], src_info [L][R*M], layout_range [L][R] int64,
// cumulative_stats [L] or null, wait_stats [R] or null (add_wait_cost). x [T][H] bf16, topk_idx [T][K];
// topk_slots [T][K] int32 (out, written by the send phase): each entry's slot, -1 = not sent. rank, num_ranks
// (combine's too): the DeviceCtx's, passed by value: loading them from ctx sat on the prologue's critical path
// (~0.25 us); ctx is read only by the waits and failure reports,
// off that path. shrink_mask: ctx's, likewise (null without shrink mode).
template <bool kUseFP8, typename TopkT>
__global__ void __launch_bounds__(kLLThreads, 1)
dispatch(void* packed_recv_x, void* packed_recv_scales, int* packed_recv_count, int* packed_recv_src_info,
         long long* packed_recv_layout_range, int* cumulative_stats, long long* wait_stats, const int4* x,
         const TopkT* topk_idx, int* topk_slots, int num_tokens, int num_topk, int round_scale, int use_ue8m0,
         void* base, const unsigned long long* peer_bases, int buffer_idx, int max_tokens, int hidden, int num_experts,
         int rank, int num_ranks, int* workspace, const int* shrink_mask, int phases, long long* stamps,
         const DeviceCtx* ctx) {
    __shared__ int hists[2 * kLLMaxExperts];  // send: the two histograms; receive: the counts' prefix
    __shared__ alignas(16) unsigned char topk_stage[kTopkStageBytes];  // send: topk_idx (stage_topk)
    __shared__ DispatchShared sh;
    __shared__ DispatchRecvShared rs;
    const LowLatencyLayout L(max_tokens, hidden, num_ranks, num_experts);
    char* b = static_cast<char*>(base);
    if (threadIdx.x == 0) init_recv_shared(rs);
    if (!(phases & kPhaseSend)) stage_masked(shrink_mask, num_ranks, sh.masked);  // (else stage_send_shared)
    __syncthreads();
    if (phases & kPhaseSend)
        dispatch_send<kUseFP8>(x, topk_idx, topk_slots, num_tokens, num_topk, round_scale != 0, b, peer_bases, L,
                               rank, buffer_idx, workspace, shrink_mask, ctx, hists, hists + kLLMaxExperts,
                               reinterpret_cast<TopkT*>(topk_stage), sh, stamps);
    if (phases & kPhaseRecv)
        dispatch_recv<kUseFP8>(packed_recv_x, packed_recv_scales, packed_recv_count, packed_recv_src_info,
                               packed_recv_layout_range, cumulative_stats, wait_stats, use_ue8m0 != 0, b, L,
                               buffer_idx, workspace, sh.masked, shrink_mask, ctx, hists, rs, stamps);
}

// ---------------------------------------------------------------------------------------------------
// combine: each expert rank sends its token owner ONE partial sum per token (the weighted fp32 sum of its
// experts' rows of that token, rounded to 24 bits on the wire, or to bf16 when the owner asked for bf16 partials:
// store_partial) instead of one bf16 row per (token, k): at top-8 of 256 on 2 ranks ~4 rows per (token, rank)
// become one row of 1.5 times the width (bf16: the same width), under 40 % (25 %) of the bytes across NVLink. The
// weights live on the owner, so the owner first sends its top-k (experts and weights, a few KB: "meta") to every
// rank; the meta flag also says which wire format the owner reads.
//   send phase  (A) owner -> every other rank r: meta (int32 entry codes: the expert and its dispatch slot, or -1
//                   (entry_code); float weights; [M][kLLMaxTopk] each), then the meta flag (W << 28 | K << 24 |
//                   T + 1) at r's signal combine_meta_flag(me);
//               (B) expert rank, per owner s (itself first, from the call's own top-k: no wait; then the
//                   others from their meta) and token t of s (blocks stride over t): the rows of t's entries
//                   from their codes (prepare_batch), then
//                   P = 0 + sum over the kept k whose expert is here, k ascending, of w_k * row(e_k, s, slot_k)
//                   (fp32 products and sums, no FMA), rounded to s's wire format into s's partial_in [me][t], then
//                   flag 1 at s's signal combine_token_flag(me, t). Tokens with no kept entry here send nothing.
//   recv phase  (C) owner, token t: out = bf16(0 + sum over ranks r ascending that hold a kept entry of t of
//                   P_r[t]) in fp32, one bf16 rounding (reference.low_latency_combine: the same order and
//                   roundings, bit for bit; the own partial computed here is rounded as the wire would).
// Every block reads each meta flag in (B): the last of them zeroes it; (C) zeroes each token flag as it reads it.
// The combine runs kLLCombineThreads (512) threads per block; in (B) the last warp only flags the rows the others
// store (combine_reduce_owner).
// ---------------------------------------------------------------------------------------------------
constexpr int kSumInFlight = 2;  // (C) ranks' partials loaded at once per thread and chunk
// Tokens whose entries one block prepares at once (prepare_batch: a warp per token; the expert side has this many
// compute warps).
constexpr int kCombineBatch = kLLCombineThreads / kWarpSize - 1;

// A top-k entry as the combine sees it (the owner's meta carries these; this rank's own come from its arguments):
// the expert and the slot the dispatch gave it (the handle's topk_slots) in one int, slot << kEntrySlotShift |
// expert, or -1 when the entry has no expert or was not sent (slot -1). The slots are below M <= kLLMaxTokens.
constexpr int kEntrySlotShift = 12;
constexpr int kLLMaxTokens = 1 << (31 - kEntrySlotShift);  // mirrors config.LL_MAX_TOKENS
static_assert(kLLMaxExperts <= 1 << kEntrySlotShift, "an expert id must fit below the slot's bits");
__device__ __forceinline__ int entry_code(long long expert, int slot, int num_experts) {
    return expert >= 0 && expert < num_experts && slot >= 0 ? (slot << kEntrySlotShift) | (int)expert : -1;
}
// This rank's own entries (the call's arguments: the dispatch's top-k and the handle's slots), f = t * K + k.
template <typename TopkT>
struct OwnEntries {
    const TopkT* topk_idx;
    const int* topk_slots;
    int num_experts;
    __device__ __forceinline__ int operator()(long long f) const {
        return entry_code((long long)topk_idx[f], topk_slots[f], num_experts);
    }
};
// A remote owner's entries: its meta's codes (read after its meta flag was acquired).
struct MetaEntries {
    const volatile int* codes;
    __device__ __forceinline__ int operator()(long long f) const { return codes[f]; }
};

struct CombineShared {
    // prepare_batch, per token j of the batch: what the sums need
    long long row[kCombineBatch][kLLMaxTopk];  // the kept entries on this rank, k order: rows in the expert input
    float weight[kCombineBatch][kLLMaxTopk];   //   and their weights, num_kept[j] of them
    int num_kept[kCombineBatch];
    unsigned long long has[kCombineBatch];     // bit r: rank r holds a kept entry of the token
    unsigned long long dropped[kCombineBatch]; // (C) shrink mode: bit r: rank r got masked waiting for its partial
    unsigned long long masked;                 // stage_masked: the ranks masked when the launch started
    int value;                                 // (B): the owner's meta flag
    int owner;                                 // (B) shrink mode: the owner served next (next_ready_owner)
    int failed;
    int flag_token[2];                         // (B) compute -> flagger, by handoff parity: the token, -1 = the end
    unsigned long long full, empty, compute;   // (B) combine_reduce_owner's mbarriers
};

// Per thread, what combine_reduce_owner's mbarriers have completed so far (the same counts on every thread that
// uses them), carried over the owners of one call.
struct HandoffPhases {
    int handoff = 0;  // rows handed to the flagger (full / empty)
    int sync = 0;     // group_mbarrier_sync barriers on sh.compute
};

// begin[l] = where owner s's rows start inside local expert l's R*M rows of the expert input (layout_range's
// begin), for every local expert; read by prepare_batch after a barrier.
__device__ __forceinline__ void stage_range_begins(const long long* layout_range, int s, const LowLatencyLayout& L,
                                                   int* begin) {
    for (int l = threadIdx.x; l < L.num_local; l += blockDim.x)
        begin[l] = (int)(layout_range[(long long)l * L.num_ranks + s] >> 32);
}

// The block's tokens t_j = t0 + j * stride (j < n <= kCombineBatch) of owner s, a warp each (warp j, lane k:
// entry (t_j, k)); `entries(f)` is the code of s's entry f = t * K + k (OwnEntries or MetaEntries), `weights` s's
// top-k weights. The codes carry the dispatch's slots, so a batch costs one round of loads and no counting.
// Writes, per j: sh.has[j]; the kept entries whose expert lives on this rank, compacted in k order: sh.row[j][i]
// (the row in the expert input [local expert][R*M]: begin[local] + slot, begin from stage_range_begins),
// sh.weight[j][i]; sh.num_kept[j]; sh.dropped[j] = 0. The caller syncs before reading them. Entries of a rank
// masked when the launch started (sh.masked) are not kept.
template <typename Entries, typename WeightT>
__device__ __forceinline__ void prepare_batch(Entries entries, const WeightT* weights, int K, int t0, int stride,
                                              int n, int rank, const LowLatencyLayout& L, const int* begin,
                                              CombineShared& sh) {
    const int j = warp_id(), k = lane_id();
    if (j >= n) return;  // uniform per warp
    const long long f = (long long)(t0 + j * stride) * K + k;
    const int code = k < K ? entries(f) : -1;
    const int ek = code & ((1 << kEntrySlotShift) - 1), slot = code >> kEntrySlotShift;
    const int at = code >= 0 ? ek / L.num_local : 0;
    const bool kept = code >= 0 && !has_rank(sh.masked, at);
    const unsigned lo = __reduce_or_sync(0xffffffffu, kept && at < 32 ? 1u << at : 0u);
    const unsigned hi = __reduce_or_sync(0xffffffffu, kept && at >= 32 ? 1u << (at - 32) : 0u);
    const bool here = kept && at == rank;
    const unsigned mask = __ballot_sync(0xffffffffu, here);
    if (here) {
        const int i = __popc(mask & ((1u << k) - 1u)), local = ek - rank * L.num_local;
        sh.row[j][i] = (long long)local * L.num_ranks * L.num_max_tokens + begin[local] + slot;
        sh.weight[j][i] = (float)weights[f];
    }
    if (k == 0) {
        sh.num_kept[j] = __popc(mask);
        sh.has[j] = (unsigned long long)hi << 32 | lo;
        sh.dropped[j] = 0;
    }
}

// The number of tokens t = index + i * count below T (the block's share of the tokens).
__device__ __forceinline__ int tokens_of_block(int T, int index, int count) {
    return index < T ? (T - index + count - 1) / count : 0;
}

// Each thread works on kCombineChunks chunks of a row at once (c and c + the threads): all their expert rows are
// copied at once into the thread's slots of the combine's dynamic shared memory by cp.async, which holds no
// registers while they travel (in registers, 2 chunks x 4 rows spilled), so a token's rows cost one round of
// loads per thread, not one per chunk and 4 rows. The slots: [entry i][chunk q][thread], 16 bytes each
// (combine_stage_bytes on the host: kLLCombineThreads x kCombineChunks x K x 16).
constexpr int kCombineChunks = 2;
__device__ __forceinline__ int4* stage_slot(int4* stage, int i, int q) {
    return stage + (i * kCombineChunks + q) * kLLCombineThreads + threadIdx.x;
}

// For the chunks q < kCombineChunks, c_q = c + q * kStride (those below row_int4): acc[q] = 0 + sum over the n
// entries i (k order) of fp32(weight[i] * rows[row[i]][c_q]) (fp32 products, then fp32 sums, no FMA:
// reference.low_latency_combine).
template <int kStride>
__device__ __forceinline__ void partial_sums(float (&acc)[kCombineChunks][8], const int4* rows, const long long* row,
                                             const float* weight, int n, int c, int row_int4, int4* stage) {
    for (int i = 0; i < n; ++i) {
        const int4* src = rows + row[i] * row_int4 + c;
#pragma unroll
        for (int q = 0; q < kCombineChunks; ++q)
            if (c + q * kStride < row_int4) cp_async16(stage_slot(stage, i, q), src + q * kStride);
    }
#pragma unroll
    for (int q = 0; q < kCombineChunks; ++q)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[q][j] = 0.0f;
    cp_async_wait_all();
    for (int i = 0; i < n; ++i) {
        const float wt = weight[i];
#pragma unroll
        for (int q = 0; q < kCombineChunks; ++q) {
            if (c + q * kStride >= row_int4) break;
            const int4 v = *stage_slot(stage, i, q);
            const unsigned w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[q][2 * j] = __fadd_rn(acc[q][2 * j], __fmul_rn(wt, bf16_lo(w[j])));
                acc[q][2 * j + 1] = __fadd_rn(acc[q][2 * j + 1], __fmul_rn(wt, bf16_hi(w[j])));
            }
        }
    }
}

// The partials' wire formats (reference.low_latency_partial_wire), chosen by the owner for its tokens:
//   kWire24     each fp32 rounded to nearest even to 24 bits. Chunk c (8 values) of a partial row: the high 16 bits
//               of each at byte 16c (a bf16 plane of H values), the next 8 bits at byte 2H + 8c (a byte plane):
//               3 bytes per value instead of 4 across NVLink;
//   kWireBf16   (bf16_partials) rounded to nearest even to 16 bits: the bf16 plane alone, 2 bytes per value;
//   kWireLogFmt (use_logfmt) LogFMT-10: per 128 values (a division: 16 chunks, a half-warp's) a sign and a 9-bit
//               code on a log2 scale, 10 bits per value plus 8 bytes per division, 1.3125 bytes per value
//               (logfmt_encode).
enum Wire : int { kWire24 = 0, kWireBf16 = 1, kWireLogFmt = 2 };
__device__ __forceinline__ unsigned wire24(float v) {
    const unsigned b = __float_as_uint(v);
    return (b + 0x7fu + ((b >> 8) & 1u)) >> 8;
}
__device__ __forceinline__ unsigned wire16(float v) {
    const unsigned b = __float_as_uint(v);
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// LogFMT-10 (cupy_ep/logfmt.py, operation for operation: fp32 products, sums and quotients rounded to nearest,
// no FMA, constants given by their bits, so the reference reproduces every decoded value bit for bit). A division's
// meta is (lmin, step): its values' magnitudes a span [2^lmin, 2^(lmin + 510 step)], lmin = max(log2 amin,
// log2 amax - 32) over the nonzero (normal) a; code 0 is zero, code k > 0 is 2^(lmin + (k-1) step); a value takes
// the code nearest on the log2 scale. The relative error is at most 2^(step/2) - 1 (step <= 32/510: 2.2 %; a
// division whose values span 8 octaves: 0.5 %), plus ~1e-7 of the polynomials. Finite values below 2^127 only.
__device__ __forceinline__ float f32_bits(unsigned b) { return __uint_as_float(b); }
// log2 of a positive normal float: its exponent plus 2/ln2 atanh(s), s = (m-1)/(m+1), m the mantissa in [0.707, 1.414]
// (|s| < 0.172: four odd terms leave < 1e-7).
__device__ __forceinline__ float logfmt_log2(float a) {
    const unsigned bits = __float_as_uint(a);
    int e = (int)(bits >> 23) - 127;
    float m = f32_bits((bits & 0x7fffffu) | 0x3f800000u);
    if (m > f32_bits(0x3fb504f3u)) {  // sqrt(2)
        m = __fmul_rn(m, 0.5f);
        e += 1;
    }
    const float s = __fdiv_rn(__fadd_rn(m, -1.0f), __fadd_rn(m, 1.0f)), z = __fmul_rn(s, s);
    float poly = f32_bits(0x3e124925u);                          // 1/7
    poly = __fadd_rn(__fmul_rn(poly, z), f32_bits(0x3e4ccccdu));  // 1/5
    poly = __fadd_rn(__fmul_rn(poly, z), f32_bits(0x3eaaaaabu));  // 1/3
    poly = __fadd_rn(__fmul_rn(poly, z), 1.0f);
    return __fadd_rn((float)e, __fmul_rn(__fmul_rn(s, poly), f32_bits(0x4038aa3bu)));  // 2/ln2
}
// 2^y: 2^n e^(f ln2), n = floor(y + 1/2), |f| <= 1/2, e^x by its Taylor polynomial to x^7 (< 1e-8 left); 0 below
// 2^-126.
__device__ __forceinline__ float logfmt_exp2(float y) {
    const float n = floorf(__fadd_rn(y, 0.5f)), x = __fmul_rn(__fadd_rn(y, -n), f32_bits(0x3f317218u));  // ln2
    const unsigned inv_fact[7] = {0x39500d01u, 0x3ab60b61u, 0x3c088889u, 0x3d2aaaabu, 0x3e2aaaabu, 0x3f000000u,
                                  0x3f800000u};  // 1/7! .. 1/1!
    float p = f32_bits(inv_fact[0]);
#pragma unroll
    for (int i = 1; i < 7; ++i) p = __fadd_rn(__fmul_rn(p, x), f32_bits(inv_fact[i]));
    p = __fadd_rn(__fmul_rn(p, x), 1.0f);
    const int ni = (int)n;
    if (ni < -126) return 0.0f;
    return __fmul_rn(p, f32_bits((unsigned)(min(ni, 127) + 127) << 23));  // (capped as the reference: < 2^127.5)
}

// One chunk's LogFMT-10 bytes: lo = the codes' low 8 bits (value j in byte j), hi = their 9th bits (bit j) and
// signs (bit 8 + j); meta = the division's (lmin, step).
struct LogFmtChunk {
    uint2 lo;
    unsigned hi;
    float2 meta;
};
// Chunk c of a division (the 16 chunks of a division are 16 consecutive lanes' c: every caller strides the
// chunks by a multiple of 16 threads and hidden % 128 == 0, so a half-warp holds whole divisions and all 16 of its
// lanes come here together).
__device__ __forceinline__ LogFmtChunk logfmt_encode(const float (&p)[8]) {
    const unsigned half = lane_id() < 16 ? 0x0000ffffu : 0xffff0000u;
    float a[8], amax = 0.0f, amin = __int_as_float(0x7f800000);  // +inf
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const bool normal = ((__float_as_uint(p[j]) >> 23) & 0xffu) != 0;
        a[j] = normal ? fabsf(p[j]) : 0.0f;
        amax = fmaxf(amax, a[j]);
        if (a[j] > 0.0f) amin = fminf(amin, a[j]);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(half, amax, o));
        amin = fminf(amin, __shfl_xor_sync(half, amin, o));
    }
    LogFmtChunk out{make_uint2(0u, 0u), 0u, make_float2(0.0f, 0.0f)};
    if (amax == 0.0f) return out;  // (uniform over the division) all zero: codes 0
    const float lmax = logfmt_log2(amax), lmin = fmaxf(logfmt_log2(amin), __fadd_rn(lmax, -32.0f));
    const float step = __fdiv_rn(__fadd_rn(lmax, -lmin), 510.0f), inv_step = __fdiv_rn(1.0f, step);
    out.meta = make_float2(lmin, step);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        unsigned code = 0;
        if (a[j] > 0.0f) {
            if (step == 0.0f) {
                code = 1;
            } else {
                const float t = __fmul_rn(__fadd_rn(logfmt_log2(a[j]), -lmin), inv_step);
                code = (unsigned)fminf(fmaxf(__fadd_rn(floorf(__fadd_rn(t, 0.5f)), 1.0f), 0.0f), 511.0f);
            }
        }
        const unsigned sign = code != 0 && (__float_as_uint(p[j]) >> 31);
        (j < 4 ? out.lo.x : out.lo.y) |= (code & 0xffu) << (8 * (j & 3));
        out.hi |= ((code >> 8) << j) | (sign << (8 + j));
    }
    return out;
}
__device__ __forceinline__ float logfmt_decode(const LogFmtChunk& w, int j) {
    const unsigned code = (((j < 4 ? w.lo.x : w.lo.y) >> (8 * (j & 3))) & 0xffu) | (((w.hi >> j) & 1u) << 8);
    if (code == 0) return 0.0f;
    const float v = logfmt_exp2(__fadd_rn(w.meta.x, __fmul_rn((float)(code - 1), w.meta.y)));
    return (w.hi >> (8 + j)) & 1u ? -v : v;
}
// Where chunk c's LogFMT bytes sit in a partial row: the divisions' meta (8 bytes each, H/16 in all), then the low
// plane (8 bytes per chunk, H), then the high plane (2 bytes per chunk, H/4).
__device__ __forceinline__ long long logfmt_lo_offset(int hidden, int c) { return hidden / 16 + 8LL * c; }
__device__ __forceinline__ long long logfmt_hi_offset(int hidden, int c) {
    return hidden / 16 + (long long)hidden + 2LL * c;
}

// Chunk c of a partial row in `wire`. The LogFMT code is a separate instantiation (kLogFmt: wire is kWireLogFmt),
// so that the 24-bit and bf16 paths compile as they did without it (one runtime branch on the wire cost the
// stamped combine ~1 us). With kLogFmt every lane of a half-warp must call it together (the division's amax /
// amin are exchanged by shuffles).
template <bool kLogFmt>
__device__ __forceinline__ void store_partial(char* row, int hidden, int c, const float (&p)[8], int wire) {
    if constexpr (kLogFmt) {
        const LogFmtChunk w = logfmt_encode(p);
        if ((c & 15) == 0) reinterpret_cast<float2*>(row)[c >> 4] = w.meta;
        *reinterpret_cast<uint2*>(row + logfmt_lo_offset(hidden, c)) = w.lo;
        *reinterpret_cast<unsigned short*>(row + logfmt_hi_offset(hidden, c)) = (unsigned short)w.hi;
        return;
    }
    const bool bf16 = wire == kWireBf16;
    unsigned hi[4], lo[2] = {0u, 0u};
    if (bf16) {
#pragma unroll
        for (int q = 0; q < 4; ++q) hi[q] = wire16(p[2 * q]) | (wire16(p[2 * q + 1]) << 16);
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const unsigned a = wire24(p[2 * q]), b = wire24(p[2 * q + 1]);
            hi[q] = (a >> 8) | ((b >> 8) << 16);
            lo[q >> 1] |= ((a & 0xffu) | ((b & 0xffu) << 8)) << (16 * (q & 1));
        }
    }
    reinterpret_cast<int4*>(row)[c] = make_int4((int)hi[0], (int)hi[1], (int)hi[2], (int)hi[3]);
    if (!bf16) reinterpret_cast<uint2*>(row + 2LL * hidden)[c] = make_uint2(lo[0], lo[1]);
}

// Chunk c of a partial row (peer-written, read after its flag was acquired, or this thread's own): its wire bytes,
// then as 8 floats. 24 / 16 bits: the bf16 plane's 16 bytes in `high`, the byte plane's 8 in `low` (zero with
// bf16); LogFMT: the division's meta in high.x / high.y, the low plane's 8 bytes in `low`, the high plane's 2 in
// high.z.
struct PartialChunk {
    int4 high;
    uint2 low;
};
__device__ __forceinline__ unsigned short ld_ring_u16(const unsigned short* p) {
    unsigned short v;
    asm volatile("ld.relaxed.gpu.global.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}
template <bool kLogFmt>
__device__ __forceinline__ PartialChunk load_partial(const char* row, int hidden, int c, int wire) {
    PartialChunk w;
    if constexpr (kLogFmt) {
        const uint2 meta = ld_ring_v2(reinterpret_cast<const uint2*>(row) + (c >> 4));
        const unsigned hi = ld_ring_u16(reinterpret_cast<const unsigned short*>(row + logfmt_hi_offset(hidden, c)));
        w.high = make_int4((int)meta.x, (int)meta.y, (int)hi, 0);
        w.low = ld_ring_v2(reinterpret_cast<const uint2*>(row + logfmt_lo_offset(hidden, c)));
        return w;
    }
    w.high = ld_ring_v4(reinterpret_cast<const int4*>(row) + c);
    w.low = wire == kWireBf16 ? make_uint2(0u, 0u)
                              : ld_ring_v2(reinterpret_cast<const uint2*>(row + 2LL * hidden) + c);
    return w;
}
template <bool kLogFmt>
__device__ __forceinline__ void add_partial(float (&acc)[8], const PartialChunk& w) {
    if constexpr (kLogFmt) {
        const LogFmtChunk chunk{w.low, (unsigned)w.high.z, make_float2(__int_as_float(w.high.x),
                                                                        __int_as_float(w.high.y))};
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], logfmt_decode(chunk, j));
        return;
    }
    const unsigned hi[4] = {(unsigned)w.high.x, (unsigned)w.high.y, (unsigned)w.high.z, (unsigned)w.high.w};
    const unsigned lo[2] = {w.low.x, w.low.y};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const unsigned high = (hi[j >> 1] >> (16 * (j & 1))) & 0xffffu, low = (lo[j >> 2] >> (8 * (j & 3))) & 0xffu;
        acc[j] = __fadd_rn(acc[j], __uint_as_float((high << 16) | (low << 8)));
    }
}

// The partial row's bytes on the wire (what an NVSHMEM put moves).
__device__ __forceinline__ long long partial_wire_bytes(const LowLatencyLayout& L, int wire) {
    return wire == kWireLogFmt ? (long long)L.hidden / 16 * 21 : wire == kWireBf16 ? 2LL * L.hidden : L.part_bytes;
}

// Meta flag: W << 28 | K << 24 | T + 1 (W the owner's Wire < 4, K <= kLLMaxTopk < 16, T < 2^24).
__device__ __forceinline__ int meta_flag_value(int num_topk, int num_tokens, int wire) {
    return (wire << 28) | (num_topk << 24) | (num_tokens + 1);
}

// The blocks that share one role of the combine: this block is number `index` of `count` (all blocks of the
// launch, or one side of the split in combine()).
struct Blocks {
    int index, count;
};

// (A) blocks b < R: the meta for rank b (not for this rank itself, nor a masked rank).
template <typename TopkT>
__device__ void combine_send_meta(OwnEntries<TopkT> own, const float* topk_weights, int num_tokens, int num_topk,
                                  int wire, char* base, const unsigned long long* peer_bases,
                                  const LowLatencyLayout& L, int rank, int buffer_idx, unsigned long long masked,
                                  Blocks blocks) {
    for (int r = blocks.index; r < L.num_ranks; r += blocks.count) {
        if (r == rank || has_rank(masked, r)) continue;  // (B) reads this rank's own top-k from the arguments
        const long long dst = L.recv_offset(buffer_idx) + L.combine_meta_in(rank);
        char* direct = reinterpret_cast<char*>(peer_bases[r]);
        char* meta = direct != nullptr ? direct + dst : base + L.recv_offset(buffer_idx) + L.combine_meta_out(r);
        int* experts = reinterpret_cast<int*>(meta);  // entry codes
        float* weights = reinterpret_cast<float*>(meta + L.meta_weights());
        for (int i = threadIdx.x; i < num_tokens * num_topk; i += blockDim.x) {
            experts[i] = own(i);
            weights[i] = topk_weights[i];
        }
        __syncthreads();
        if (direct == nullptr && warp_id() == 0) {
            ll_put_warp(base + dst, meta, (size_t)L.meta_bytes, r);
            __syncwarp();
            if (lane_id() == 0) ll_quiet();
        }
        if (threadIdx.x == 0)
            send_signal(base, peer_bases, r, L.signal_offset(buffer_idx) + 4LL * L.combine_meta_flag(rank),
                        meta_flag_value(num_topk, num_tokens, wire));
        __syncthreads();
    }
}

// (B) compute side: publish token t (or -1, the end) to the flagger; its previous one must have been read.
__device__ __forceinline__ void hand_to_flagger(int t, CombineShared& sh, HandoffPhases& ph) {
    if (ph.handoff > 0) mbarrier_wait(&sh.empty, (ph.handoff - 1) & 1);
    if (threadIdx.x == 0) sh.flag_token[ph.handoff & 1] = t;
    group_mbarrier_sync(&sh.compute, ph.sync);  // flag_token written
    mbarrier_arrive(&sh.full);
    ++ph.handoff;
}

// (B), one owner s: the partial sums of its tokens t = index + j * count (T tokens, K entries each:
// `entries` / `weights` are the owner's meta, or this rank's own arguments when s is this rank; begin: s's
// stage_range_begins), in s's wire format (Wire: the one the owner asked for).
// Warp roles: the first blockDim - 32 threads (compute) prepare the block's tokens a batch at a time
// (prepare_batch) and store each token's partial row; the last warp (flagger) flags each stored row, so the
// system-scope release, which waits for the row's NVLink stores to be acknowledged, overlaps the next token's
// loads instead of holding up the block. The handoff is a pair of mbarriers (combine_reduce sets them up; `phase`
// counts the handoffs, alike on both sides): `full` (the compute threads arrive once a token's row is stored:
// release at CTA scope; the flagger's wait acquires, so its release at system scope covers those stores) and
// `empty` (the flagger has read the token number: the compute side may publish the next one, at most one row
// ahead of the flagger). Token -1 ends the owner. The compute warps sync among themselves on a third mbarrier
// (group_mbarrier_sync), not a named barrier: with `bar.sync 1, n` racecheck reported a race across the next
// __syncthreads, most likely counting the flagger warp, which skips the named barrier, as a warp behind on
// block barriers; with the mbarrier it reports none.
template <bool kLogFmt, typename Entries, typename WeightT>
__device__ __forceinline__ void combine_reduce_owner(int s, Entries entries, const WeightT* weights, int T, int K,
                                                     int wire, const int4* rows, const int* begin, int4* stage,
                                                     char* base,
                                                     const unsigned long long* peer_bases, const LowLatencyLayout& L,
                                                     int rank, int buffer_idx, CombineShared& sh,
                                                     HandoffPhases& ph, Blocks blocks, long long* stamps) {
    const int row_int4 = L.hidden / 8;  // bf16 input row: chunks of 8 values
    constexpr int compute_threads = kLLCombineThreads - kWarpSize;
    char* recv = base + L.recv_offset(buffer_idx);
    char* direct = reinterpret_cast<char*>(peer_bases[s]);
    if ((int)threadIdx.x >= compute_threads) {  // the flagger warp
        for (;;) {
            mbarrier_wait(&sh.full, ph.handoff & 1);
            const int t = sh.flag_token[ph.handoff & 1];
            mbarrier_arrive(&sh.empty);
            ++ph.handoff;
            if (t < 0) break;
            const long long dst = L.recv_offset(buffer_idx) + L.combine_partial_in(rank, t);
            if (direct == nullptr) {
                ll_put_warp(base + dst, recv + L.combine_partial_out(s, t), (size_t)partial_wire_bytes(L, wire), s);
                __syncwarp();
                if (lane_id() == 0) ll_quiet();
            }
            if (lane_id() == 0) {
                send_signal(base, peer_bases, s, L.signal_offset(buffer_idx) + 4LL * L.combine_token_flag(rank, t), 1);
                stamp_by(stamps, kStampSendWritten, true);
            }
        }
    } else {
        const auto sync = [&] { group_mbarrier_sync(&sh.compute, ph.sync); };
        const int mine = tokens_of_block(T, blocks.index, blocks.count);
        for (int j0 = 0; j0 < mine; j0 += kCombineBatch) {
            const int n = min(kCombineBatch, mine - j0), t0 = blocks.index + j0 * blocks.count;
            prepare_batch(entries, weights, K, t0, blocks.count, n, rank, L, begin, sh);
            sync();
            for (int j = 0; j < n; ++j) {
                if (sh.num_kept[j] == 0) continue;  // uniform: nothing to send for this token
                const int t = t0 + j * blocks.count;
                char* out = direct != nullptr ? direct + L.recv_offset(buffer_idx) + L.combine_partial_in(rank, t)
                                              : recv + L.combine_partial_out(s, t);
                for (int c = threadIdx.x; c < row_int4; c += kCombineChunks * compute_threads) {
                    float acc[kCombineChunks][8];
                    partial_sums<compute_threads>(acc, rows, sh.row[j], sh.weight[j], sh.num_kept[j], c, row_int4,
                                                   stage);
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
                        if (c + q * compute_threads < row_int4)
                            store_partial<kLogFmt>(out, L.hidden, c + q * compute_threads, acc[q], wire);
                }
                stamp(stamps, kStampSendEncoded);
                hand_to_flagger(t, sh, ph);
            }
            sync();  // the batch's entries are read: the next batch may overwrite them
        }
        hand_to_flagger(-1, sh, ph);
    }
    __syncthreads();  // both roles are done with the shared entries (the next owner reuses them)
}

// combine_reduce_owner in owner s's wire: the LogFMT instantiation or the 24-bit / bf16 one (store_partial).
template <typename... Args>
__device__ __forceinline__ void reduce_owner_as(bool logfmt, Args&&... args) {
    if (logfmt) combine_reduce_owner<true>(static_cast<Args&&>(args)...);
    else combine_reduce_owner<false>(static_cast<Args&&>(args)...);
}

// (B), thread 0: owner s's meta flag, acquired with value v, into sh.value; consumed once every block of this role
// has read it (the readers' acquires precede their adds).
__device__ __forceinline__ void take_meta(int* flag, int v, int s, int* meta_readers, Blocks blocks,
                                          CombineShared& sh) {
    sh.value = v;
    if (atomicAdd(meta_readers + s, 1) == blocks.count - 1) {
        meta_readers[s] = 0;
        *flag = 0;
    }
}

// (B) shrink mode, thread 0: the next owner to serve among `todo` (bit r: owner r, not served yet), the first from
// rank + 1 on whose meta flag is in (its value into v), so that an owner that never sends delays none that does
// (their partials are waited for with the same timeout). One wait covers them all: its timeout masks the first of
// them (wait_until), which is dropped with any other masked meanwhile, and the rest are waited for again. Returns
// -1 once none is left, -2 on a failure that stops the buffer.
__device__ __forceinline__ int next_ready_owner(const int* signals, const LowLatencyLayout& L, int rank,
                                                unsigned long long& todo, const int* shrink_mask,
                                                const DeviceCtx* ctx, int& v) {
    const int R = L.num_ranks;
    for (;;) {
        int first = -1;
        for (int i = 1; i < R; ++i) {
            const int r = (rank + i) % R;
            if (has_rank(todo, r) && ld_volatile(shrink_mask + r) != 0) todo &= ~(1ull << r);
            if (has_rank(todo, r) && first < 0) first = r;
        }
        if (first < 0) return -1;
        int s = -1;
        const bool ok = wait_until<true>(ctx, WaitSite{kKernelLowLatencyCombine, kRoleReceiver, -1, first},
                                         [&] {
                                             for (int i = 1; i < R; ++i) {
                                                 const int r = (rank + i) % R;
                                                 if (!has_rank(todo, r)) continue;
                                                 if ((v = ld_acquire_sys(signals + L.combine_meta_flag(r))) != 0) {
                                                     s = r;
                                                     return true;
                                                 }
                                             }
                                             return false;
                                         },
                                         [&](long long& head, long long& tail, long long& expected) {
                                             head = ld_volatile(signals + L.combine_meta_flag(first));
                                             tail = 0;
                                             expected = 1;
                                         });
        if (ok) {
            todo &= ~(1ull << s);
            return s;
        }
        if (!peer_dropped(shrink_mask, first)) return -2;
    }
}

// (B) the partial sums of every owner's tokens: this rank's own first (its top-k are the kernel's arguments: no
// wait), meanwhile the remote owners' meta arrives. own_in_recv (both phases in one launch): the own tokens'
// partials are left to (C), which computes them before waiting for the peers' (no flag, and the remote owners'
// rows go first); a hook's receive phase runs later, when the caller may already reuse x, so there they are sent
// here like the others. begin: shared memory for stage_range_begins. The remote owners in the order
// (rank + 1, rank + 2, ...), or in shrink mode as their meta comes in (next_ready_owner), the masked ones skipped.
template <typename TopkT>
__device__ __forceinline__ void combine_reduce(const int4* x, bool zero_copy, const long long* layout_range,
                                               OwnEntries<TopkT> own, const float* topk_weights, int num_tokens,
                                               int num_topk, int wire, char* base,
                                               const unsigned long long* peer_bases,
                                               const LowLatencyLayout& L, int rank, int buffer_idx, int* meta_readers,
                                               const int* shrink_mask, const DeviceCtx* ctx, int* begin, int4* stage,
                                               CombineShared& sh, bool own_in_recv, Blocks blocks, long long* stamps) {
    const int R = L.num_ranks;
    int* signals = reinterpret_cast<int*>(base + L.signal_offset(buffer_idx));
    const char* recv = base + L.recv_offset(buffer_idx);
    const int4* rows = zero_copy ? reinterpret_cast<const int4*>(base + L.send_offset(buffer_idx)) : x;
    if (threadIdx.x == 0) {  // combine_reduce_owner's mbarriers, for all owners of this call (ph counts on)
        mbarrier_init(&sh.full, kLLCombineThreads - kWarpSize);  // the compute threads (the launch's blockDim)
        mbarrier_init(&sh.empty, kWarpSize);
        mbarrier_init(&sh.compute, kLLCombineThreads - kWarpSize);
    }
    if (!own_in_recv) stage_range_begins(layout_range, rank, L, begin);
    __syncthreads();
    HandoffPhases ph;
    if (!own_in_recv)
        reduce_owner_as(wire == kWireLogFmt, rank, own, topk_weights, num_tokens, num_topk, wire, rows, begin,
                        stage, base, peer_bases, L, rank, buffer_idx, sh, ph, blocks, stamps);
    stamp(stamps, kStampSendPrepared);  // the own tokens' partials are written and flagged (hook mode)
    unsigned long long todo = 0;  // shrink mode, thread 0: the remote owners not served yet (next_ready_owner)
    for (int r = 0; shrink_mask != nullptr && r < R; ++r)
        if (r != rank && !has_rank(sh.masked, r)) todo |= 1ull << r;
    for (int i = 1; i < R; ++i) {
        int s = (rank + i) % R;
        if (shrink_mask == nullptr) {
            // while the meta travels (the previous owner ended with a block barrier, so begin is free)
            stage_range_begins(layout_range, s, L, begin);
            if (threadIdx.x == 0) {
                int* flag = signals + L.combine_meta_flag(s);
                int v = 0;
                const bool ok = wait_until(ctx, WaitSite{kKernelLowLatencyCombine, kRoleReceiver, -1, s},
                                           [&] { return (v = ld_acquire_sys(flag)) != 0; },
                                           [&](long long& head, long long& tail, long long& expected) {
                                               head = ld_volatile(flag);
                                               tail = 0;
                                               expected = 1;
                                           });
                if (ok) take_meta(flag, v, s, meta_readers, blocks, sh);
                else sh.failed = 1;
            }
            __syncthreads();
        } else {  // (uniform)
            if (threadIdx.x == 0) {
                int v = 0;
                const int next = next_ready_owner(signals, L, rank, todo, shrink_mask, ctx, v);
                if (next >= 0) take_meta(signals + L.combine_meta_flag(next), v, next, meta_readers, blocks, sh);
                if (next == -2) sh.failed = 1;
                sh.owner = next;
            }
            __syncthreads();
            s = sh.owner;
            if (s >= 0) stage_range_begins(layout_range, s, L, begin);  // read after the barrier below
        }
        if (i == 1) stamp(stamps, kStampSendRouted);  // the first remote owner's meta is in
        if (sh.failed) return;  // uniform
        if (s < 0) break;       // (shrink mode) no owner left
        const int K = (sh.value >> 24) & 0xf, T = (sh.value & 0xffffff) - 1;
        const int owner_wire = (sh.value >> 28) & 3;  // the wire format owner s reads
        __syncthreads();  // sh.value is read by every thread before thread 0 waits for the next owner
        const char* meta = recv + L.combine_meta_in(s);
        reduce_owner_as(owner_wire == kWireLogFmt, s, MetaEntries{reinterpret_cast<const volatile int*>(meta)},
                        reinterpret_cast<const volatile float*>(meta + L.meta_weights()), T, K, owner_wire, rows,
                        begin, stage, base, peer_bases, L, rank, buffer_idx, sh, ph, blocks, stamps);
    }
}

template <typename TopkT>
__device__ void combine_send(const int4* x, bool zero_copy, const long long* layout_range, OwnEntries<TopkT> own,
                             const float* topk_weights, int num_tokens, int num_topk, int wire, char* base,
                             const unsigned long long* peer_bases, const LowLatencyLayout& L, int rank,
                             int buffer_idx, int* workspace, const int* shrink_mask, const DeviceCtx* ctx, int* begin,
                             int4* stage, CombineShared& sh, bool own_in_recv, Blocks blocks, long long* stamps) {
    stamp(stamps, kStampSendStart);
    combine_send_meta(own, topk_weights, num_tokens, num_topk, wire, base, peer_bases, L, rank, buffer_idx, sh.masked,
                      blocks);
    combine_reduce(x, zero_copy, layout_range, own, topk_weights, num_tokens, num_topk, wire, base, peer_bases,
                   L, rank, buffer_idx, workspace + kWsMetaReaders, shrink_mask, ctx, begin, stage, sh, own_in_recv,
                   blocks, stamps);
    stamp_after_barrier(stamps, kStampSendEnd);
}

// (C) the owner's sum of the partials, a batch of the block's tokens at a time (prepare_batch: which ranks hold a
// kept entry of each). own_in_recv: first this rank's own partials of the batch's tokens are computed here from x
// (while the peers' partials are on their way) into this rank's own partial_in slots in the wire format (what a
// peer's would carry); each thread reads back only the chunks it wrote. Then per token: wait for the peers'
// flags, sum. wire: the format of this rank's partials (its own and the peers'), as its meta flag asked. Shrink
// mode: a rank masked while this rank waits for its partial of a token (sh.dropped) is left out of the token's sum.
template <bool kLogFmt, typename TopkT>
__device__ void combine_recv(int4* combined_x, const int4* x, bool zero_copy, const long long* layout_range,
                             OwnEntries<TopkT> own, const float* topk_weights, int num_tokens, int num_topk,
                             int wire, char* base, const LowLatencyLayout& L, int rank, int buffer_idx,
                             const int* shrink_mask, const DeviceCtx* ctx, int* begin, int4* stage, CombineShared& sh,
                             bool own_in_recv, Blocks blocks, long long* wait_stats, long long* stamps) {
    stamp_after_barrier(stamps, kStampRecvStart);
    long long waited = 0;  // thread r < R: the cycles spent waiting for rank r's flags (wait_stats)
    const int R = L.num_ranks, row_int4 = L.hidden / 8;
    constexpr int threads = kLLCombineThreads;
    int* signals = reinterpret_cast<int*>(base + L.signal_offset(buffer_idx));
    char* recv = base + L.recv_offset(buffer_idx);
    const int4* rows = zero_copy ? reinterpret_cast<const int4*>(base + L.send_offset(buffer_idx)) : x;
    stage_range_begins(layout_range, rank, L, begin);
    __syncthreads();  // begin is read by prepare_batch (racecheck reports a race without it)
    const int mine = tokens_of_block(num_tokens, blocks.index, blocks.count);
    for (int j0 = 0; j0 < mine; j0 += kCombineBatch) {
        const int n = min(kCombineBatch, mine - j0), t0 = blocks.index + j0 * blocks.count;
        prepare_batch(own, topk_weights, num_topk, t0, blocks.count, n, rank, L, begin, sh);
        __syncthreads();
        if (own_in_recv) {
            for (int j = 0; j < n; ++j) {
                if (sh.num_kept[j] == 0) continue;  // uniform: this rank holds no kept entry of the token
                char* own = recv + L.combine_partial_in(rank, t0 + j * blocks.count);
                // the same chunks per thread as the sums' reads below
                for (int c = threadIdx.x; c < row_int4; c += kCombineChunks * threads) {
                    float p[kCombineChunks][8];
                    partial_sums<threads>(p, rows, sh.row[j], sh.weight[j], sh.num_kept[j], c, row_int4, stage);
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
                        if (c + q * threads < row_int4)
                            store_partial<kLogFmt>(own, L.hidden, c + q * threads, p[q], wire);
                }
            }
            stamp_after_barrier(stamps, kStampRecvPrepared);  // the block's own partials (of this batch) are computed
        }
        for (int j = 0; j < n; ++j) {
            const int t = t0 + j * blocks.count;
            const unsigned long long has = sh.has[j];
            if ((int)threadIdx.x < R) {
                const int r = threadIdx.x;
                if ((has >> r & 1ull) && !(own_in_recv && r == rank)) {
                    int* flag = signals + L.combine_token_flag(r, t);
                    const long long waiting_since = wait_clock(wait_stats);
                    const bool ok = wait_until<true>(ctx, WaitSite{kKernelLowLatencyCombine, kRoleReceiver, t, r},
                                                     [&] { return ld_acquire_sys(flag) != 0; },
                                                     [&](long long& head, long long& tail, long long& expected) {
                                                         head = ld_volatile(flag);
                                                         tail = t;
                                                         expected = 1;
                                                     });
                    waited += waited_since(wait_stats, waiting_since);
                    if (ok) *flag = 0;  // consumed
                    else if (peer_dropped(shrink_mask, r)) atomicOr(&sh.dropped[j], 1ull << r);
                    else sh.failed = 1;
                }
            }
            __syncthreads();
            const unsigned long long got = has & ~sh.dropped[j];  // the ranks whose partials are summed
            if (t == blocks.index) stamp(stamps, kStampRecvFirstData);  // the first token's partials are in
            if (sh.failed) {  // uniform: every thread read it after the barrier
                if ((int)threadIdx.x < R) add_wait_cost(wait_stats, threadIdx.x, waited);
                return;
            }
            for (int c = threadIdx.x; c < row_int4; c += kCombineChunks * threads) {
                float acc[kCombineChunks][8] = {};
                // ranks ascending (the reference's order); kSumInFlight ranks' partials in flight per chunk
                for (int r0 = 0; r0 < R; r0 += kSumInFlight) {
                    PartialChunk w[kCombineChunks][kSumInFlight];
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
#pragma unroll
                        for (int u = 0; u < kSumInFlight; ++u)
                            if (r0 + u < R && (got >> (r0 + u) & 1ull) && c + q * threads < row_int4)
                                w[q][u] = load_partial<kLogFmt>(recv + L.combine_partial_in(r0 + u, t), L.hidden,
                                                       c + q * threads, wire);
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
#pragma unroll
                        for (int u = 0; u < kSumInFlight; ++u)
                            if (r0 + u < R && (got >> (r0 + u) & 1ull)) add_partial<kLogFmt>(acc[q], w[q][u]);
                }
#pragma unroll
                for (int q = 0; q < kCombineChunks; ++q)
                    if (c + q * threads < row_int4)
                        combined_x[(long long)t * row_int4 + c + q * threads] =
                            make_int4((int)pack_bf16x2(acc[q][0], acc[q][1]), (int)pack_bf16x2(acc[q][2], acc[q][3]),
                                      (int)pack_bf16x2(acc[q][4], acc[q][5]), (int)pack_bf16x2(acc[q][6], acc[q][7]));
            }
        }
        __syncthreads();  // the batch's entries are read: the next batch may overwrite them
    }
    if ((int)threadIdx.x < R) add_wait_cost(wait_stats, threadIdx.x, waited);
    stamp(stamps, kStampRecvEnd);  // the loop ends with a block barrier
}

// combine_recv in this rank's wire: the LogFMT instantiation or the 24-bit / bf16 one (store_partial).
template <typename... Args>
__device__ __forceinline__ void combine_recv_as(bool logfmt, Args&&... args) {
    if (logfmt) combine_recv<true>(static_cast<Args&&>(args)...);
    else combine_recv<false>(static_cast<Args&&>(args)...);
}

// combined_x [T][H] bf16; x [L][R*M][H] bf16 (unused with zero_copy: the rows are in the send buffer);
// layout_range [L][R] and topk_slots [T][K] int32 from the dispatch handle; topk_idx [T][K] (the dispatch's),
// topk_weights [T][K] float32; wait_stats [R] or null (add_wait_cost); wire: the Wire of this rank's tokens'
// partials (bf16_partials / use_logfmt; the peers learn it from the meta flag).
template <typename TopkT>
__global__ void __launch_bounds__(kLLCombineThreads, 1)
combine(int4* combined_x, const int4* x, const long long* layout_range, const TopkT* topk_idx, const int* topk_slots,
        const float* topk_weights, long long* wait_stats, int num_tokens, int num_topk, int zero_copy,
        int wire, void* base, const unsigned long long* peer_bases, int buffer_idx, int max_tokens,
        int hidden, int num_experts, int rank, int num_ranks, int* workspace, const int* shrink_mask, int phases,
        long long* stamps, const DeviceCtx* ctx) {
    __shared__ int begin[kLLMaxExperts];  // stage_range_begins: the rows of one owner in each local expert
    extern __shared__ __align__(16) int4 ll_stage[];  // partial_sums' slots (combine_stage_bytes)
    __shared__ CombineShared sh;
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
            combine_send(x, zero_copy != 0, layout_range, own, topk_weights, num_tokens, num_topk, wire, b,
                         peer_bases, L, rank, buffer_idx, workspace, shrink_mask, ctx, begin, ll_stage, sh, true,
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
        combine_send(x, zero_copy != 0, layout_range, own, topk_weights, num_tokens, num_topk, wire, b,
                     peer_bases, L, rank, buffer_idx, workspace, shrink_mask, ctx, begin, ll_stage, sh, own_in_recv,
                     all, stamps);
    __syncthreads();
    if ((phases & kPhaseRecv) && !sh.failed)  // uniform; a send phase that timed out stops here
        combine_recv_as(wire == kWireLogFmt, combined_x, x, zero_copy != 0, layout_range, own, topk_weights,
                        num_tokens, num_topk, wire, b, L, rank, buffer_idx, shrink_mask, ctx, begin, ll_stage, sh,
                        own_in_recv, all, wait_stats, stamps);
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
