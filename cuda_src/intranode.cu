// intranode.cu: the normal (high-throughput) path inside one NVLink domain, over CUDA-IPC buffers.
//
// Kernels (all templated on kNumRanks, 2..8):
//   barrier               all ranks meet (signal counters in every rank's buffer)
//   notify_dispatch       count exchange -> rank/channel prefix matrices, per-expert counts to the host
//   cached_notify_dispatch  reuse a handle: only reset the rings
//   dispatch              channels = SM pairs (even block sends channel c, odd block receives it), plus
//                         blocks that copy the rank's own rows
//   dispatch_direct       zero-copy dispatch: rows stored straight into the receivers' outputs in their buffers
//   cached_notify_combine reset the combine rings, publish the token count
//   combine               reverse direction, reduced on the token's owner (channels of its own)
//   combine_direct        zero-copy combine: rows stored straight into the owners' buffers, reduced as they land
//   carve_probe           writes the layout sums (tests compare them with cupy_ep/config.py)
//
// Each kernel's roles (or steps) are member functions of its context struct (intranode/dispatch.cuh, combine.cuh,
// dispatch_direct.cuh); dispatch_role_of / combine_role_of map a warp to its role.
// Flow control per (channel, peer) ring: common/ring.cuh's protocol (the producer waits until Q - (tail - head) >=
// chunk, writes the payload, then publishes tail with a release store; the consumer acquires tail, reads, returns
// head).
#include "common/wait.cuh"
#include "common/layout.cuh"
#include "common/ring.cuh"
#include "intranode/groups.cuh"
#include "intranode/handshake.cuh"
#include "intranode/notify.cuh"
#include "intranode/dispatch.cuh"
#include "intranode/dispatch_direct.cuh"
#include "intranode/combine.cuh"

namespace ep {

using namespace intranode;

template <int kNumRanks>
__global__ void barrier(void** buffer_ptrs, int rank, const DeviceCtx* ctx) {
    barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kKernelBarrier);
}

// ---------------------------------------------------------------------------------------------------
// notify_dispatch: grid 1 + R blocks of 128 threads.
// Block 0: barrier; write my row of token counts and my per-expert counts into every peer; barrier;
//   prefix over sources -> rank_prefix_matrix; aligned per-expert sums and the receive count -> host;
//   zero my dispatch ring meta; barrier.
// Block 1 + dst: channel_prefix_matrix[dst][c] = inclusive prefix over channels of my tokens to dst.
// ---------------------------------------------------------------------------------------------------
template <int kNumRanks>
__global__ void notify_dispatch(const int* num_tokens_per_rank, const int* num_tokens_per_expert, int num_experts,
                                const bool* is_token_in_rank, int num_tokens, int num_channels, int expert_alignment,
                                int* rank_prefix_matrix, int* channel_prefix_matrix, int* host_recv_counter,
                                int* host_expert_counters, void** buffer_ptrs, int rank, int num_slots, int hidden_int4,
                                int num_topk, int num_scales, int direct_capacity, const DeviceCtx* ctx) {
    const NotifyContext<kNumRanks> c{num_tokens_per_rank,
                                     num_tokens_per_expert,
                                     num_experts,
                                     is_token_in_rank,
                                     num_tokens,
                                     num_channels,
                                     expert_alignment,
                                     rank_prefix_matrix,
                                     channel_prefix_matrix,
                                     host_recv_counter,
                                     host_expert_counters,
                                     buffer_ptrs,
                                     rank,
                                     num_slots,
                                     hidden_int4,
                                     num_topk,
                                     num_scales,
                                     direct_capacity,
                                     ctx};
    if (blockIdx.x == 0)
        c.count_exchange();
    else
        c.channel_prefix();
}

// Ring dispatches only: a zero-copy cached dispatch enters by its own handshake (open_direct_call).
template <int kNumRanks>
__global__ void cached_notify_dispatch(void** buffer_ptrs, int rank, int num_channels, int num_slots, int hidden_int4,
                                       int num_topk, int num_scales, const DeviceCtx* ctx) {
    long long meta_begin, meta_end;
    dispatch_meta_range(kNumRanks, num_channels, num_slots, hidden_int4, num_topk, num_scales, 0, meta_begin, meta_end);
    const CallWords words = dispatch_call_words(true, num_channels, num_slots, hidden_int4, num_topk, num_scales, 0, 0);
    reset_rings<kNumRanks>(buffer_ptrs, rank, meta_begin, meta_end, words, ctx, kKernelCachedNotifyDispatch);
}

// Also publishes num_tokens: a combine sender needs the token owner's count to cut its channels.
// Ring combines only: a zero-copy combine enters by its own handshake (open_direct_call).
template <int kNumRanks>
__global__ void cached_notify_combine(void** buffer_ptrs, int rank, int num_channels, int num_slots, int hidden_int4,
                                      int num_topk, int num_tokens, const DeviceCtx* ctx) {
    const CombineLayout layout(num_channels, kNumRanks, num_slots, hidden_int4, num_topk);
    const CallWords words{{kOpCombine, num_channels, num_slots, hidden_int4, num_topk, 0, 0, 0}};
    reset_rings<kNumRanks>(buffer_ptrs, rank, layout.begin, layout.meta_end, words, ctx, kKernelCachedNotifyCombine,
                           num_tokens);
}

// ---------------------------------------------------------------------------------------------------
// dispatch: grid 2C + O blocks of Groups<R>::kThreads threads (Config.intranode_dispatch_split picks C and O).
// Blocks 2c and 2c + 1 are channel c's sender and receiver; blocks 2C .. 2C + O - 1 copy the own rows.
// Sender: every warp writes to a remote peer (RemoteGroups: the warps are spread over the R-1 peers). A
//   sender SM's NVLink bandwidth is bound by the bytes its warps keep in flight (about 1.8 GB/s per warp,
//   measured), so none of them is spent on the own rank's rows.
// Receiver: its warps grouped over the R-1 remote sources (RemoteGroups again); a group drains the ring
//   (c, source) into the outputs with bulk copies.
// Own-row blocks: this rank's own tokens go from x straight into the outputs at their final rows: one
//   local copy instead of x -> ring -> recv_x, no flow control, and SMs of their own, because a receiver SM
//   is already busy with its rings (its copies read and write HBM: about 95 GB/s of traffic per SM).
// send_head[t][r] = the row of token t inside rank r's block of rows from this rank (the count of earlier
// tokens sent to r), -1 if not sent: independent of channels, so a combine may use other channels.
// ---------------------------------------------------------------------------------------------------

template <int kNumRanks, typename IdxT>
__global__ void __launch_bounds__(Groups<kNumRanks>::kThreads, 1)
    dispatch(int4* recv_x, float* recv_x_scales, int* recv_src_idx, IdxT* recv_topk_idx, float* recv_topk_weights,
             int* recv_channel_prefix_matrix, int* send_head, const int4* x, const float* x_scales,
             const IdxT* topk_idx, const float* topk_weights, const bool* is_token_in_rank,
             const int* channel_prefix_matrix, const int* rank_prefix_matrix, int num_tokens, int num_worst_tokens,
             int hidden_int4, int num_topk, int num_experts, int num_scales, long long scale_token_stride,
             long long scale_hidden_stride, void** buffer_ptrs, int rank, int num_channels, int num_max_send_tokens,
             int num_slots, const DeviceCtx* ctx) {
    __shared__ DispatchShared<kNumRanks> sh;
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // receivers: kTmaChunkBytes per warp
    if (block_aborted(ctx)) return;
    const DispatchContext<kNumRanks, IdxT> c{recv_x,
                                             recv_x_scales,
                                             recv_src_idx,
                                             recv_topk_idx,
                                             recv_topk_weights,
                                             recv_channel_prefix_matrix,
                                             send_head,
                                             x,
                                             x_scales,
                                             topk_idx,
                                             topk_weights,
                                             is_token_in_rank,
                                             channel_prefix_matrix,
                                             rank_prefix_matrix,
                                             num_tokens,
                                             num_worst_tokens,
                                             hidden_int4,
                                             num_topk,
                                             num_experts,
                                             num_scales,
                                             scale_token_stride,
                                             scale_hidden_stride,
                                             buffer_ptrs,
                                             rank,
                                             num_channels,
                                             num_max_send_tokens,
                                             num_slots,
                                             ctx,
                                             sh,
                                             s_tma_buf};
    const RoleOf role = dispatch_role_of<kNumRanks>(blockIdx.x, num_channels, rank);
    if ((int)blockIdx.x < 2 * num_channels && blockIdx.x % 2 == 0) {  // a sender block
        c.publish_own_channel_start();
        if (role.role == kSender) c.sender(role.target);
    } else {
        // The receivers' copies are local (HBM to HBM): bulk copies keep 8 KB per warp in flight.
        TmaCopier tma;
        tma.init(s_tma_buf + warp_id() * kTmaChunkBytes, &sh.tma_bar[warp_id()]);
        if (role.role == kOwnRows)
            c.own_rows(tma, role.target);
        else if (role.role == kReceiver)
            c.receiver(tma, role.target);
        if (lane_id() == 0) tma.finish();  // the outputs are written before the kernel ends
        __syncwarp();
    }
    c.mark_worst_rows();
}

// ---------------------------------------------------------------------------------------------------
// dispatch_direct (zero_copy=True): grid of G blocks (any G; the ranks need not agree on it) of
// Groups<R>::kThreads threads, every block a writer. There is no ring: a receiver's output lives in its buffer
// (DirectDispatchLayout), and a token's row there is known before anything moves (the rank's block of rows from
// rank_prefix_matrix, the token's place in it from is_token_in_rank), so every block copies its tokens' rows
// straight to their final rows on every rank that gets them: one load of x, one store per destination, no flow
// control, no receiver SMs. That is the plain copy kernel's access pattern (the benchmark's ceiling).
// Then each block releases its rows to each destination with one counter add, waits until its own rank's
// counter shows every row (all ranks' blocks), and copies a share of the small per-row outputs out of the
// buffer into the caller's fresh arrays. The rows themselves stay in the buffer: recv_x is a view of it.
// ---------------------------------------------------------------------------------------------------

template <int kNumRanks, typename IdxT>
__global__ void __launch_bounds__(Groups<kNumRanks>::kThreads, 1)
    dispatch_direct(float* recv_x_scales, int* recv_src_idx, IdxT* recv_topk_idx, float* recv_topk_weights,
                    int* recv_channel_prefix_matrix, int* send_head, const int4* x, const float* x_scales,
                    const IdxT* topk_idx, const float* topk_weights, const bool* is_token_in_rank,
                    const int* channel_prefix_matrix, const int* rank_prefix_matrix, int num_tokens, int num_out_rows,
                    int hidden_int4, int num_topk, int num_experts, int num_scales, long long scale_token_stride,
                    long long scale_hidden_stride, void** buffer_ptrs, int rank, int num_channels, int capacity,
                    int num_local_blocks, int enter, const DeviceCtx* ctx) {
    __shared__ DirectDispatchShared<kNumRanks> sh;
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // kTmaChunkBytes per warp: the own rows' bulk copies
    if (block_aborted(ctx)) return;
    DirectDispatchContext<kNumRanks, IdxT> c{recv_x_scales,
                                             recv_src_idx,
                                             recv_topk_idx,
                                             recv_topk_weights,
                                             recv_channel_prefix_matrix,
                                             send_head,
                                             x,
                                             x_scales,
                                             topk_idx,
                                             topk_weights,
                                             is_token_in_rank,
                                             channel_prefix_matrix,
                                             rank_prefix_matrix,
                                             num_tokens,
                                             num_out_rows,
                                             hidden_int4,
                                             num_topk,
                                             num_experts,
                                             num_scales,
                                             scale_token_stride,
                                             scale_hidden_stride,
                                             buffer_ptrs,
                                             rank,
                                             num_channels,
                                             capacity,
                                             num_local_blocks,
                                             enter,
                                             ctx,
                                             sh};
    if (!c.fits()) return;
    // enter: a cached call opens by the entry handshake (no notify kernel before it); its wait comes after the
    // set-up below, which reads only this rank's inputs. Otherwise notify_dispatch met the ranks and zeroed the meta.
    const CallWords words = dispatch_call_words(true, num_channels, 0, hidden_int4, num_topk, num_scales, 0, capacity);
    const int epoch =
        enter ? open_direct_call<kNumRanks>(buffer_ptrs, rank, words, c.layout.begin, c.layout.meta_end) : 0;
    c.plan();
    __syncthreads();
    if (enter && !wait_direct_call<kNumRanks>(buffer_ptrs, rank, words, epoch, ctx, kKernelDispatchDirect)) return;
    c.publish_channel_starts();
    TmaCopier tma;
    tma.init(s_tma_buf + warp_id() * kTmaChunkBytes, &sh.tma_bar[warp_id()]);
    const int my_count = c.write_rows(tma);
    // The own rows' bulk stores are complete before the release (nothing in this kernel reads them; the caller's
    // next kernel does).
    if (lane_id() == 0) tma.finish();
    __syncthreads();
    if (!c.release_and_wait(my_count)) return;
    c.copy_outputs();
}

// ---------------------------------------------------------------------------------------------------
// combine: grid 2C, Groups<R>::kThreads threads; its channels need not be the dispatch's: channel c is the
// token owner's tokens [b, e) = channel_range(owner's count, C, c).
// Even block c = sender: for every remote token owner `peer` (RemoteGroups: all warps write across NVLink),
// the rows of x that came from peer's tokens [b, e) (a run of rows: found by searching recv_src_idx, which
// is sorted inside peer's block) go, in order, into peer's ring (c, rank). Ring counters are absolute: the
// first row's counter is its index inside peer's block, i.e. exactly the owner's send_head value, so slot =
// send_head % slots on both sides.
// Odd block c = receiver on the owner: batches of tokens of channel c; wait until every remote ring's tail
// passes the batch's largest send_head, reduce in fp32 (0 + bias0 + bias1 + contributions in ascending rank
// order: deterministic), round once to bf16, release the slots. The own rank's contributions are read
// straight from x: row (own block start + send_head).
// ---------------------------------------------------------------------------------------------------

template <int kNumRanks>
__global__ void __launch_bounds__(Groups<kNumRanks>::kThreads, 1)
    combine(int4* combined_x, float* combined_topk_weights, const int4* x, const float* topk_weights, const int4* bias0,
            const int4* bias1, const int* rank_prefix_matrix, const int* recv_src_idx, const int* send_head,
            int num_tokens, int hidden_int4, int num_topk, void** buffer_ptrs, int rank, int num_max_send_tokens,
            int num_slots, const DeviceCtx* ctx) {
    __shared__ CombineShared<kNumRanks> sh;
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // receiver: kTmaChunkBytes per warp
    if (block_aborted(ctx)) return;
    const CombineContext<kNumRanks> c{combined_x,
                                      combined_topk_weights,
                                      x,
                                      topk_weights,
                                      bias0,
                                      bias1,
                                      rank_prefix_matrix,
                                      recv_src_idx,
                                      send_head,
                                      num_tokens,
                                      hidden_int4,
                                      num_topk,
                                      buffer_ptrs,
                                      rank,
                                      num_max_send_tokens,
                                      num_slots,
                                      ctx,
                                      sh,
                                      s_tma_buf};
    const RoleOf role = combine_role_of<kNumRanks>(blockIdx.x, rank);
    // (a kIdle warp just returns: no block-wide barrier follows on a sender block)
    if (role.role == kSender)
        c.sender(role.target);
    else if (role.role == kReceiver)
        c.receiver();
}

// ---------------------------------------------------------------------------------------------------
// combine_direct (zero_copy=True): grid of G blocks of Groups<R>::kThreads threads; the first num_sender_blocks
// store, the others reduce. There is no ring: a row's place in its owner's buffer is known to both sides (the
// owner's send_head is the row's index in the expert rank's block of rows from that owner), so
//   senders:  every warp takes chunks of rows_per_flag rows of this rank's x, for each owner in turn, and
//             stores them (and their top-k weights) at their place in the owner's buffer, then releases the
//             chunk with one flag; no flow control, nothing to wait for;
//   reducers: every warp takes tokens of this rank: lane r waits for the flag of the token's row from rank r
//             (the own rank's row is read from x), then the warp sums 0 + bias0 + bias1 + the rows in
//             ascending rank order in fp32 and rounds once to bf16 (the ring combine's arithmetic, bit for bit).
// The senders and reducers are different SMs, so the reductions run while the rows land.
// ---------------------------------------------------------------------------------------------------
template <int kNumRanks>
__global__ void __launch_bounds__(Groups<kNumRanks>::kThreads, 1)
    combine_direct(int4* combined_x, float* combined_topk_weights, const int4* x, const float* topk_weights,
                   const int4* bias0, const int4* bias1, const int* rank_prefix_matrix, const int* send_head,
                   int num_tokens, int hidden_int4, int num_topk, void** buffer_ptrs, int rank, int capacity,
                   int rows_per_flag, int num_sender_blocks, const DeviceCtx* ctx) {
    __shared__ DirectCombineShared<kNumRanks> sh;
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // reducers: kTmaChunkBytes per warp
    if (block_aborted(ctx)) return;
    const DirectCombineContext<kNumRanks> c{combined_x,
                                            combined_topk_weights,
                                            x,
                                            topk_weights,
                                            bias0,
                                            bias1,
                                            rank_prefix_matrix,
                                            send_head,
                                            num_tokens,
                                            hidden_int4,
                                            num_topk,
                                            buffer_ptrs,
                                            rank,
                                            capacity,
                                            rows_per_flag,
                                            num_sender_blocks,
                                            ctx,
                                            sh,
                                            s_tma_buf};
    if (!c.fits()) return;
    // The entry handshake (no notify kernel before it): block 0 zeroes the flags that rows sent to this rank can
    // use (each rank sends at most num_tokens rows back to it, one flag per rows_per_flag).
    const CallWords words{{kOpDirectCombine, 0, 0, hidden_int4, num_topk, 0, 0, capacity}};
    const long long flags_end = c.layout.begin + min((long long)num_tokens, c.layout.capacity) * kNumRanks * 4;
    const int epoch = open_direct_call<kNumRanks>(buffer_ptrs, rank, words, c.layout.begin, flags_end);
    if (!wait_direct_call<kNumRanks>(buffer_ptrs, rank, words, epoch, ctx, kKernelCombineDirect)) return;

    if ((int)blockIdx.x < num_sender_blocks)
        c.sender();
    else
        c.reducer();
}

// Layout sums for the size test: out[0] = dispatch carve bytes, out[1] = combine carve bytes,
// out[2] = offset where the channel area starts, out[3] = zero-copy dispatch carve bytes for `capacity` rows,
// out[4] = zero-copy combine carve bytes for `capacity` rows per rank.
__global__ void carve_probe(int num_channels, int num_ranks, int num_slots, int hidden_int4, int num_topk,
                            int num_scales, int capacity, long long* out) {
    const DispatchLayout d(num_channels, num_ranks, num_slots, hidden_int4, num_topk, num_scales);
    const CombineLayout c(num_channels, num_ranks, num_slots, hidden_int4, num_topk);
    const DirectDispatchLayout z(num_channels, capacity, hidden_int4, num_topk, num_scales);
    const DirectCombineLayout zc(num_ranks, capacity, hidden_int4, num_topk);
    out[0] = d.total_end - d.begin;
    out[1] = c.total_end - c.begin;
    out[2] = d.begin;
    out[3] = z.total_end - z.begin;
    out[4] = zc.total_end - zc.begin;
}

}  // namespace ep
