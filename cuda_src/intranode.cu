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
// Flow control per (channel, peer) ring: common/ring.cuh's protocol (the producer waits until Q - (tail - head) >=
// chunk, writes the payload, then publishes tail with a release store; the consumer acquires tail, reads, returns
// head).
#include "common/wait.cuh"
#include "common/layout.cuh"
#include "common/ring.cuh"
#include "intranode/groups.cuh"
#include "intranode/handshake.cuh"
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
__global__ void notify_dispatch(const int* num_tokens_per_rank, const int* num_tokens_per_expert,
                                int num_experts, const bool* is_token_in_rank, int num_tokens, int num_channels,
                                int expert_alignment, int* rank_prefix_matrix, int* channel_prefix_matrix,
                                int* host_recv_counter, int* host_expert_counters, void** buffer_ptrs,
                                int rank, int num_slots, int hidden_int4, int num_topk, int num_scales,
                                int direct_capacity, const DeviceCtx* ctx) {
    if (blockIdx.x == 0) {
        const NotifyArea notify;
        const int experts_per_rank = num_experts / kNumRanks;
        if (!barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kKernelNotifyDispatch)) return;
        const CallWords words = dispatch_call_words(false, num_channels, num_slots, hidden_int4, num_topk, num_scales,
                                                    num_experts, direct_capacity);
        publish_call_words<kNumRanks>(buffer_ptrs, rank, words);
        for (int i = threadIdx.x; i < kNumRanks * kNumRanks; i += blockDim.x) {
            const int peer = i / kNumRanks, dst = i % kNumRanks;
            notify.rank_matrix.on(buffer_ptrs[peer])[rank * kNumRanks + dst] = num_tokens_per_rank[dst];
        }
        for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {
            const int peer = i / experts_per_rank, e = i % experts_per_rank;
            notify.expert_counts.on(buffer_ptrs[peer])[rank * kMaxLocalExperts + e] = num_tokens_per_expert[i];
        }
        if (!barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kKernelNotifyDispatch)) return;
        if (!check_call_words<kNumRanks>(buffer_ptrs, rank, words, ctx, kKernelNotifyDispatch)) return;

        void* mine = buffer_ptrs[rank];
        const int* matrix = notify.rank_matrix.on(mine);
        if (threadIdx.x < kNumRanks) {
            const int dst = threadIdx.x;
            int sum = 0;
            for (int src = 0; src < kNumRanks; ++src) {
                sum += ld_volatile(&matrix[src * kNumRanks + dst]);
                rank_prefix_matrix[src * kNumRanks + dst] = sum;
            }
        }
        if (host_expert_counters != nullptr) {
            const int* counts = notify.expert_counts.on(mine);
            for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
                int sum = 0;
                for (int src = 0; src < kNumRanks; ++src) sum += ld_volatile(&counts[src * kMaxLocalExperts + e]);
                host_expert_counters[e] = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
            }
        }
        long long meta_begin, meta_end;
        dispatch_meta_range(kNumRanks, num_channels, num_slots, hidden_int4, num_topk, num_scales, direct_capacity,
                            meta_begin, meta_end);
        zero_ints(at_offset<int>(mine, meta_begin), (meta_end - meta_begin) / 4);
        __threadfence_system();
        __syncthreads();
        // A zero-copy dispatch that does not fit a receiver stops here on every rank (all see the same matrix),
        // before the host learns its count: the host raises instead of launching the dispatch.
        if (direct_capacity > 0 && threadIdx.x == 0) {
            for (int dst = 0; dst < kNumRanks; ++dst) {
                int total = 0;
                for (int src = 0; src < kNumRanks; ++src) total += ld_volatile(&matrix[src * kNumRanks + dst]);
                if (total > direct_capacity) {
                    report_failure(ctx, WaitSite{kKernelNotifyDispatch, kRoleZeroCopyCapacity, -1, dst}, total,
                                   direct_capacity, -1, 0);
                    break;
                }
            }
        }
        if (threadIdx.x == 0 && host_recv_counter != nullptr) {
            int total = 0;
            for (int src = 0; src < kNumRanks; ++src) total += ld_volatile(&matrix[src * kNumRanks + rank]);
            st_volatile(host_recv_counter, total);
            __threadfence_system();
        }
        barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kKernelNotifyDispatch);
    } else {
        const int dst = blockIdx.x - 1;
        const int num_warps = blockDim.x / kWarpSize;
        for (int c = warp_id(); c < num_channels; c += num_warps) {
            int begin, end;
            channel_range(num_tokens, num_channels, c, begin, end);
            int count = 0;
            for (int t = begin + lane_id(); t < end; t += kWarpSize)
                count += is_token_in_rank[(long long)t * kNumRanks + dst];
            count = warp_reduce_sum(count);
            if (lane_id() == 0) channel_prefix_matrix[dst * num_channels + c] = count;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int c = 1; c < num_channels; ++c)
                channel_prefix_matrix[dst * num_channels + c] += channel_prefix_matrix[dst * num_channels + c - 1];
        }
    }
}

// Ring dispatches only: a zero-copy cached dispatch enters by its own handshake (open_direct_call).
template <int kNumRanks>
__global__ void cached_notify_dispatch(void** buffer_ptrs, int rank, int num_channels, int num_slots,
                                       int hidden_int4, int num_topk, int num_scales, const DeviceCtx* ctx) {
    long long meta_begin, meta_end;
    dispatch_meta_range(kNumRanks, num_channels, num_slots, hidden_int4, num_topk, num_scales, 0, meta_begin,
                        meta_end);
    const CallWords words = dispatch_call_words(true, num_channels, num_slots, hidden_int4, num_topk, num_scales, 0, 0);
    reset_rings<kNumRanks>(buffer_ptrs, rank, meta_begin, meta_end, words, ctx, kKernelCachedNotifyDispatch);
}

// Also publishes num_tokens: a combine sender needs the token owner's count to cut its channels.
// Ring combines only: a zero-copy combine enters by its own handshake (open_direct_call).
template <int kNumRanks>
__global__ void cached_notify_combine(void** buffer_ptrs, int rank, int num_channels, int num_slots,
                                      int hidden_int4, int num_topk, int num_tokens, const DeviceCtx* ctx) {
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
         int* recv_channel_prefix_matrix, int* send_head,
         const int4* x, const float* x_scales, const IdxT* topk_idx, const float* topk_weights,
         const bool* is_token_in_rank, const int* channel_prefix_matrix, const int* rank_prefix_matrix,
         int num_tokens, int num_worst_tokens, int hidden_int4, int num_topk, int num_experts, int num_scales,
         long long scale_token_stride, long long scale_hidden_stride,
         void** buffer_ptrs, int rank, int num_channels, int num_max_send_tokens, int num_slots,
         const DeviceCtx* ctx) {
    using G = Groups<kNumRanks>;
    using RG = RemoteGroups<kNumRanks>;
    const int channel = blockIdx.x / 2;
    const bool is_own_rows = (int)blockIdx.x >= 2 * num_channels;
    const bool is_sender = !is_own_rows && (blockIdx.x % 2) == 0;
    __shared__ int s_value[kNumRanks];
    __shared__ int s_abort[kNumRanks];
    __shared__ int s_start[kNumRanks];
    __shared__ int s_count[kNumRanks];
    __shared__ unsigned long long s_tma_bar[G::kWarps];
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // receivers: kTmaChunkBytes per warp
    if (block_aborted(ctx)) return;

    const DispatchLayout layout(num_channels, kNumRanks, num_slots, hidden_int4, num_topk, num_scales);
    const long long row_bytes = (long long)hidden_int4 * 16;
    if (is_sender) {
        // The own source's channel start (what a ring receiver learns from its sender's start value).
        if (threadIdx.x == 0 && recv_channel_prefix_matrix != nullptr)
            recv_channel_prefix_matrix[rank * num_channels + channel] =
                channel > 0 ? channel_prefix_matrix[rank * num_channels + channel - 1] : 0;
        const int peer = RG::peer_of_warp(rank);  // destination
        if (peer >= 0) {
            const int experts_per_rank = num_experts / kNumRanks;
            int begin, end;
            channel_range(num_tokens, num_channels, channel, begin, end);
            const int warp_in_group = RG::warp_in_group();
            const bool leader = warp_in_group == 0 && lane_id() == 0;
            const int bar_id = 1 + peer;
            void* dst_base = buffer_ptrs[peer];
            const RingProducer<> ring{layout.tail.on(dst_base, channel, rank), layout.head.on(dst_base, channel, rank),
                                      num_slots};
            int4* ring_x = layout.x.on(dst_base, channel, rank);
            int* ring_src = layout.src_idx.on(dst_base, channel, rank);
            int* ring_topk = layout.topk_idx.on(dst_base, channel, rank);
            float* ring_weights = layout.topk_weights.on(dst_base, channel, rank);
            float* ring_scales = layout.scales.on(dst_base, channel, rank);
            // Tokens of earlier channels sent to peer: the first row of this channel in peer's block.
            const int sent_before = channel > 0 ? channel_prefix_matrix[peer * num_channels + channel - 1] : 0;

            if (leader) {  // -v-1 so that 0 keeps meaning "not written yet"
                st_relaxed_sys(layout.start.on(dst_base, channel, rank), -sent_before - 1);
                st_relaxed_sys(layout.end.on(dst_base, channel, rank),
                               -channel_prefix_matrix[peer * num_channels + channel] - 1);
            }
            // Tokens are scanned in windows of 32: one load + ballot gives the window's selected tokens and
            // their ring counters; the k-th selected token goes to warp (counter % warps). Every warp computes
            // the same counters, so the group only meets to claim slots (per batch) and to publish the tail.
            int cached_tail = 0, cached_head = 0, published = 0;  // cached_head: leader only
            for (int b0 = begin; b0 < end; b0 += RG::kBatchTokens) {
                if (leader) {
                    bool ok = true;
                    if (!ring.has_space(cached_tail, cached_head, RG::kBatchTokens)) {
                        ok = ring.wait_for_space(ctx, WaitSite{kKernelDispatch, kRoleSender, channel, peer}, cached_tail,
                                                 cached_head, RG::kBatchTokens,
                                                 [&](long long& h, long long& tl, long long& ex) {
                                                     h = cached_head; tl = cached_tail; ex = RG::kBatchTokens;
                                                 });
                    }
                    s_abort[peer] = !ok;
                }
                group_sync(bar_id, RG::kThreadsPerPeer);
                if (s_abort[peer]) break;
                const int b_end = min(b0 + RG::kBatchTokens, end);
                for (int w0 = b0; w0 < b_end; w0 += kWarpSize) {
                    const int window = (w0 - begin) / kWarpSize;
                    const int t_lane = w0 + lane_id();
                    const bool selected = t_lane < end && is_token_in_rank[(long long)t_lane * kNumRanks + peer];
                    const unsigned mask = __ballot_sync(0xffffffffu, selected);
                    const int num_selected = __popc(mask);
                    if (send_head != nullptr && window % RG::kWarpsPerPeer == warp_in_group && t_lane < end)
                        send_head[(long long)t_lane * kNumRanks + peer] =
                            selected ? sent_before + cached_tail + __popc(mask & ((1u << lane_id()) - 1u)) : -1;
                    int j = (warp_in_group - cached_tail % RG::kWarpsPerPeer + RG::kWarpsPerPeer) % RG::kWarpsPerPeer;
                    for (; j < num_selected; j += RG::kWarpsPerPeer) {
                        const int t = w0 + nth_set_bit(mask, j);
                        const int slot = (cached_tail + j) % num_slots;
                        warp_copy<false, kSendUnroll>(ring_x + (long long)slot * hidden_int4,
                                                      x + (long long)t * hidden_int4, hidden_int4);
                        if (lane_id() == 0) ring_src[slot] = t;
                        if (topk_idx != nullptr) {
                            for (int k = lane_id(); k < num_topk; k += kWarpSize) {
                                const long long e = (long long)topk_idx[(long long)t * num_topk + k];
                                const long long local = e - (long long)peer * experts_per_rank;
                                const bool owned = e >= 0 && local >= 0 && local < experts_per_rank;
                                ring_topk[slot * num_topk + k] = owned ? (int)local : -1;
                                ring_weights[slot * num_topk + k] =
                                    owned && topk_weights != nullptr ? topk_weights[(long long)t * num_topk + k] : 0.0f;
                            }
                        }
                        for (int i = lane_id(); i < num_scales; i += kWarpSize)
                            ring_scales[slot * num_scales + i] = x_scales[t * scale_token_stride + i * scale_hidden_stride];
                    }
                    cached_tail += num_selected;
                }
                // Publish once a chunk has accumulated (and at the end): all warps of the group wrote their rows.
                if (cached_tail - published >= num_max_send_tokens || b_end >= end) {
                    group_sync(bar_id, RG::kThreadsPerPeer);
                    if (leader) ring.release(cached_tail);
                    published = cached_tail;
                }
            }
        }
    } else {
        // The receivers' copies are local (HBM to HBM): bulk copies keep 8 KB per warp in flight.
        TmaCopier tma;
        tma.init(s_tma_buf + warp_id() * kTmaChunkBytes, &s_tma_bar[warp_id()]);
        const int peer = is_own_rows ? -1 : RG::peer_of_warp(rank);  // source
        if (is_own_rows) {
            copy_own_rows<kNumRanks, IdxT>(blockIdx.x - 2 * num_channels, gridDim.x - 2 * num_channels, tma, recv_x,
                                           recv_x_scales, recv_src_idx, recv_topk_idx, recv_topk_weights, send_head,
                                           x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                                           channel_prefix_matrix, rank_prefix_matrix, num_tokens, num_channels,
                                           hidden_int4, num_topk, num_experts, num_scales, scale_token_stride,
                                           scale_hidden_stride, rank);
        } else if (peer >= 0) {
            const int warp_in_group = RG::warp_in_group();
            const bool leader = warp_in_group == 0 && lane_id() == 0;
            const int bar_id = 1 + peer;
            void* mine = buffer_ptrs[rank];
            int* start_ptr = layout.start.on(mine, channel, peer);
            int* end_ptr = layout.end.on(mine, channel, peer);
            const RingConsumer ring{layout.tail.on(mine, channel, peer), layout.head.on(mine, channel, peer)};
            const int4* ring_x = layout.x.on(mine, channel, peer);
            const int* ring_src = layout.src_idx.on(mine, channel, peer);
            const int* ring_topk = layout.topk_idx.on(mine, channel, peer);
            const float* ring_weights = layout.topk_weights.on(mine, channel, peer);
            const float* ring_scales = layout.scales.on(mine, channel, peer);

            if (leader) {
                int start = 0, stop = 0;
                const bool ok = wait_until(ctx, WaitSite{kKernelDispatch, kRoleReceiver, channel, peer},
                                           [&] {
                                               start = ld_volatile(start_ptr);
                                               stop = ld_volatile(end_ptr);
                                               return start != 0 && stop != 0;
                                           },
                                           [&](long long& h, long long& tl, long long& ex) {
                                               h = start; tl = stop; ex = -1;
                                           });
                s_abort[peer] = !ok;
                s_start[peer] = -start - 1;
                s_count[peer] = (-stop - 1) - (-start - 1);
                if (ok && recv_channel_prefix_matrix != nullptr)
                    recv_channel_prefix_matrix[peer * num_channels + channel] = -start - 1;
            }
            group_sync(bar_id, RG::kThreadsPerPeer);
            const bool aborted = s_abort[peer];
            const int num_to_recv = s_count[peer];
            int row = (peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + rank] : 0) + s_start[peer];
            group_sync(bar_id, RG::kThreadsPerPeer);  // everyone has read s_abort before the leader reuses it
            if (!aborted) {
                int cached_head = 0;
                while (cached_head < num_to_recv) {
                    if (leader) {
                        int tail = cached_head;
                        const bool ok = ring.wait_for_data(ctx, WaitSite{kKernelDispatch, kRoleReceiver, channel, peer},
                                                           cached_head + 1, tail,
                                                           [&](long long& h, long long& tl, long long& ex) {
                                                               h = cached_head; tl = tail; ex = num_to_recv;
                                                           });
                        s_abort[peer] = !ok;
                        s_value[peer] = tail;
                    }
                    group_sync(bar_id, RG::kThreadsPerPeer);
                    if (s_abort[peer]) break;
                    const int tail = s_value[peer];
                    if (lane_id() == 0) fence_proxy_async();  // the bulk loads read what the peer wrote
                    for (int i = warp_in_group; i < tail - cached_head; i += RG::kWarpsPerPeer) {
                        const int slot = (cached_head + i) % num_slots;
                        const long long out = row + i;
                        if (lane_id() == 0) tma.copy(recv_x + out * hidden_int4, ring_x + (long long)slot * hidden_int4, row_bytes);
                        if (lane_id() == 0 && recv_src_idx != nullptr) recv_src_idx[out] = ld_volatile(&ring_src[slot]);
                        if (recv_topk_idx != nullptr) {
                            for (int k = lane_id(); k < num_topk; k += kWarpSize) {
                                recv_topk_idx[out * num_topk + k] = (IdxT)ld_volatile(&ring_topk[slot * num_topk + k]);
                                recv_topk_weights[out * num_topk + k] = ld_volatile(&ring_weights[slot * num_topk + k]);
                            }
                        }
                        for (int s = lane_id(); s < num_scales; s += kWarpSize)
                            recv_x_scales[out * num_scales + s] = ld_volatile(&ring_scales[slot * num_scales + s]);
                    }
                    row += tail - cached_head;
                    cached_head = tail;
                    group_sync(bar_id, RG::kThreadsPerPeer);  // all reads of the slots are done
                    if (leader) ring.release(cached_head);
                }
            }
        }
        if (lane_id() == 0) tma.finish();  // the outputs are written before the kernel ends
        __syncwarp();
    }
    // num_worst_tokens: rows past the real count carry recv_topk_idx = -1 (the rest is left as is).
    if (num_worst_tokens > 0 && recv_topk_idx != nullptr) {
        const long long num_recv = rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + rank];
        const long long stride = (long long)gridDim.x * blockDim.x;
        for (long long i = num_recv * num_topk + (long long)blockIdx.x * blockDim.x + threadIdx.x;
             i < (long long)num_worst_tokens * num_topk; i += stride)
            recv_topk_idx[i] = (IdxT)-1;
    }
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
                int* recv_channel_prefix_matrix, int* send_head,
                const int4* x, const float* x_scales, const IdxT* topk_idx, const float* topk_weights,
                const bool* is_token_in_rank, const int* channel_prefix_matrix, const int* rank_prefix_matrix,
                int num_tokens, int num_out_rows, int hidden_int4, int num_topk, int num_experts, int num_scales,
                long long scale_token_stride, long long scale_hidden_stride,
                void** buffer_ptrs, int rank, int num_channels, int capacity, int num_local_blocks, int enter,
                const DeviceCtx* ctx) {
    using G = Groups<kNumRanks>;
    __shared__ int s_base[kNumRanks];        // this block's first position in its rank's block of rows on rank d
    __shared__ int s_first_row[kNumRanks];   // the same as a row of rank d's output
    __shared__ int4* s_dst_x[kNumRanks];     // rank d's zero-copy rows
    __shared__ unsigned long long s_tma_bar[G::kWarps];
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // kTmaChunkBytes per warp: the own rows' bulk copies
    if (block_aborted(ctx)) return;
    const DirectDispatchLayout layout(num_channels, capacity, hidden_int4, num_topk, num_scales);
    // Every rank reads the same matrix, so all ranks stop alike (no block is left waiting for skipped rows).
    const int* totals = rank_prefix_matrix + (kNumRanks - 1) * kNumRanks;  // rows each rank receives
    for (int d = 0; d < kNumRanks; ++d) {
        if (totals[d] > capacity) {
            if (blockIdx.x == 0 && threadIdx.x == 0)
                report_failure(ctx, WaitSite{kKernelDispatchDirect, kRoleZeroCopyCapacity, -1, d}, totals[d],
                               capacity, -1, 0);
            return;
        }
    }
    // enter: a cached call opens by the entry handshake (no notify kernel before it); its wait comes after the
    // set-up below, which reads only this rank's inputs. Otherwise notify_dispatch met the ranks and zeroed the meta.
    const CallWords words = dispatch_call_words(true, num_channels, 0, hidden_int4, num_topk, num_scales, 0, capacity);
    const int epoch = enter ? open_direct_call<kNumRanks>(buffer_ptrs, rank, words, layout.begin, layout.meta_end) : 0;

    // Roles: with num_local_blocks > 0 the last num_local_blocks blocks copy only the rows this rank keeps (local
    // HBM copies) and the others only the rows for its peers (NVLink stores); 0: every block writes both.
    const bool split = num_local_blocks > 0 && num_local_blocks < (int)gridDim.x && kNumRanks > 1;
    const bool local_role = split && (int)blockIdx.x >= (int)gridDim.x - num_local_blocks;
    const int role_blocks = !split ? (int)gridDim.x : local_role ? num_local_blocks : (int)gridDim.x - num_local_blocks;
    const int role_index = local_role ? (int)blockIdx.x - ((int)gridDim.x - num_local_blocks) : (int)blockIdx.x;
    const unsigned role_targets = !split ? 0xffffffffu : local_role ? (1u << rank) : ~(1u << rank);
    // This block's tokens: equal shares of whole windows of 32 among its role's blocks. Warp d < R counts the
    // tokens of the range's first channel that lie before it (channel_prefix_matrix: the count before it).
    const int num_windows = (num_tokens + kWarpSize - 1) / kWarpSize;
    const int per_block = (num_windows + role_blocks - 1) / role_blocks * kWarpSize;
    const int begin = min(role_index * per_block, num_tokens), end = min(begin + per_block, num_tokens);
    if (warp_id() < kNumRanks) {
        const int d = warp_id();
        int base = 0;
        if (begin < end) {
            const int per_channel = (num_tokens + num_channels - 1) / num_channels;
            const int first_channel = begin / per_channel;
            // independent loads (no ballot chain): up to a channel of tokens costs one load latency, not one per 32
            int before = 0;
#pragma unroll 8
            for (int t = first_channel * per_channel + lane_id(); t < begin; t += kWarpSize)
                before += is_token_in_rank[(long long)t * kNumRanks + d];
            base = warp_reduce_sum(before) + (first_channel > 0 ? channel_prefix_matrix[d * num_channels + first_channel - 1] : 0);
        }
        if (lane_id() == 0) {
            s_base[d] = base;
            s_first_row[d] = (rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + d] : 0) + base;
            s_dst_x[d] = layout.x.on(buffer_ptrs[d]);
        }
    }
    __syncthreads();
    if (enter && !wait_direct_call<kNumRanks>(buffer_ptrs, rank, words, epoch, ctx, kKernelDispatchDirect)) return;
    // Block 0: where each of my channels starts in every rank's block of rows from me.
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < kNumRanks * num_channels; i += blockDim.x) {
            const int d = i / num_channels, c = i % num_channels;
            layout.channel_starts.on(buffer_ptrs[d])[rank * num_channels + c] =
                c > 0 ? channel_prefix_matrix[d * num_channels + c - 1] : 0;
        }
    }

    // Every warp scans every window (R loads + ballots) and takes the tokens j with j % warps == its index.
    // Lane d < R keeps rank d's numbers: the window's selection mask and the count of earlier windows.
    TmaCopier tma;
    tma.init(s_tma_buf + warp_id() * kTmaChunkBytes, &s_tma_bar[warp_id()]);
    const int experts_per_rank = num_experts / kNumRanks;
    const int my_rank_lane = min(lane_id(), kNumRanks - 1);
    int my_count = 0;
    for (int w0 = begin; w0 < end; w0 += kWarpSize) {
        const int t_lane = w0 + lane_id();
        unsigned my_mask = 0;
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            const unsigned m = __ballot_sync(0xffffffffu, t_lane < end && is_token_in_rank[(long long)t_lane * kNumRanks + d]);
            if (lane_id() == d) my_mask = m;
        }
        const int j0 = w0 - begin;
        for (int l = (warp_id() - j0 % G::kWarps + G::kWarps) % G::kWarps; l < kWarpSize && w0 + l < end;
             l += G::kWarps) {
            const int t = w0 + l;
            const bool selected = lane_id() < kNumRanks && ((my_mask >> l) & 1u);
            const int pos = my_count + __popc(my_mask & ((1u << l) - 1u));  // inside this block's share
            const int row = s_first_row[my_rank_lane] + pos;                 // lane d: the row on rank d
            if (send_head != nullptr && lane_id() < kNumRanks && ((role_targets >> lane_id()) & 1u))
                send_head[(long long)t * kNumRanks + lane_id()] = selected ? s_base[lane_id()] + pos : -1;
            const unsigned targets = __ballot_sync(0xffffffffu, selected) & role_targets;
            if (targets == 0) continue;
            const int4* src = x + (long long)t * hidden_int4;
            // A row only for this rank is a local copy (HBM to HBM): a bulk copy keeps 8 KB per warp in flight where
            // the register path keeps 2 KB (own-row blocks at 24 SMs: 6 of them 212.5 us, against 230.7 with
            // register copies). A row also for peers goes through registers to all its ranks: one load feeds every
            // store (a bulk copy of the own row next to it took the fused 8-SM dispatch from ~310 to 336.5 us).
            if (targets == (1u << rank)) {
                const long long own_row = __shfl_sync(0xffffffffu, row, rank);
                if (lane_id() == 0) tma.copy(s_dst_x[rank] + own_row * hidden_int4, src, (long long)hidden_int4 * 16);
            } else {
                warp_copy_to_targets<kNumRanks>(s_dst_x, row, targets, src, hidden_int4);
            }
#pragma unroll 1
            for (int d = 0; d < kNumRanks; ++d) {
                if (!((targets >> d) & 1u)) continue;
                void* dst = buffer_ptrs[d];
                const long long r = __shfl_sync(0xffffffffu, row, d);
                if (send_head != nullptr && lane_id() == 0) layout.src_idx.on(dst)[r] = t;
                if (topk_idx != nullptr) {
                    for (int k = lane_id(); k < num_topk; k += kWarpSize) {
                        const long long e = (long long)topk_idx[(long long)t * num_topk + k];
                        const long long local = e - (long long)d * experts_per_rank;
                        const bool owned = e >= 0 && local >= 0 && local < experts_per_rank;
                        layout.topk_idx.on(dst)[r * num_topk + k] = owned ? (int)local : -1;
                        layout.topk_weights.on(dst)[r * num_topk + k] =
                            owned && topk_weights != nullptr ? topk_weights[(long long)t * num_topk + k] : 0.0f;
                    }
                }
                for (int i = lane_id(); i < num_scales; i += kWarpSize)
                    layout.scales.on(dst)[r * num_scales + i] = x_scales[t * scale_token_stride + i * scale_hidden_stride];
            }
        }
        my_count += __popc(my_mask);
    }

    // Release this block's rows to each rank with one add (block 0 adds one more: its channel starts). The
    // barrier orders the other threads' stores before thread d's system-scope fence. The own rows' bulk stores
    // are complete first (nothing in this kernel reads them; the caller's next kernel does).
    if (lane_id() == 0) tma.finish();
    __syncthreads();
    if (threadIdx.x < kNumRanks) {
        const int n = ((role_targets >> threadIdx.x) & 1u ? my_count : 0) + (blockIdx.x == 0);
        if (n > 0) {
            fence_acq_rel_sys();
            atomicAdd_system(layout.done.on(buffer_ptrs[threadIdx.x]), n);
        }
    }
    // Wait until every row of this rank's output is in: the rows from all ranks plus one per source's block 0.
    void* mine = buffer_ptrs[rank];
    const int num_recv = totals[rank];
    bool ok = true;
    if (threadIdx.x == 0) {
        const int* done = layout.done.on(mine);
        const int expected = num_recv + kNumRanks;
        int seen = 0;
        ok = wait_until(ctx, WaitSite{kKernelDispatchDirect, kRoleReceiver, (int)blockIdx.x, -1},
                        [&] { return (seen = ld_acquire_sys(done)) >= expected; },
                        [&](long long& h, long long& tl, long long& ex) { h = seen; tl = seen; ex = expected; });
    }
    if (!__syncthreads_and(ok)) return;

    // The small outputs: this block's share of the rows, from the buffer into the caller's arrays.
    const int rows_out = min(num_recv, num_out_rows);
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if (recv_src_idx != nullptr)
        for (long long i = gid; i < rows_out; i += stride) recv_src_idx[i] = ld_volatile(layout.src_idx.on(mine) + i);
    if (recv_topk_idx != nullptr) {
        for (long long i = gid; i < (long long)num_out_rows * num_topk; i += stride) {
            const bool real = i < (long long)rows_out * num_topk;  // rows past the real count: expert -1
            recv_topk_idx[i] = real ? (IdxT)ld_volatile(layout.topk_idx.on(mine) + i) : (IdxT)-1;
            if (real) recv_topk_weights[i] = ld_volatile(layout.topk_weights.on(mine) + i);
        }
    }
    if (recv_x_scales != nullptr)
        for (long long i = gid; i < (long long)rows_out * num_scales; i += stride)
            recv_x_scales[i] = ld_volatile(layout.scales.on(mine) + i);
    if (recv_channel_prefix_matrix != nullptr && blockIdx.x == 0)
        for (int i = threadIdx.x; i < kNumRanks * num_channels; i += blockDim.x)
            recv_channel_prefix_matrix[i] = ld_volatile(layout.channel_starts.on(mine) + i);
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
combine(int4* combined_x, float* combined_topk_weights, const int4* x, const float* topk_weights,
        const int4* bias0, const int4* bias1, const int* rank_prefix_matrix,
        const int* recv_src_idx, const int* send_head, int num_tokens, int hidden_int4,
        int num_topk, void** buffer_ptrs, int rank, int num_max_send_tokens, int num_slots,
        const DeviceCtx* ctx) {
    using G = Groups<kNumRanks>;
    const int num_channels = gridDim.x / 2;
    const int channel = blockIdx.x / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const CombineLayout layout(num_channels, kNumRanks, num_slots, hidden_int4, num_topk);
    __shared__ int s_abort[kNumRanks];
    __shared__ int s_need[kNumRanks];
    __shared__ int s_slot[Groups<kNumRanks>::kWarps][kNumRanks];
    __shared__ const int4* s_src[Groups<kNumRanks>::kWarps][kNumRanks + 2];  // receiver warp: its token's sources
    __shared__ int s_heads[Groups<kNumRanks>::kWarps * kCombineTokensPerWarp][kNumRanks];  // receiver: the batch's send_head
    __shared__ unsigned long long s_tma_bar[G::kWarps];
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // receiver: kTmaChunkBytes per warp
    if (block_aborted(ctx)) return;

    if (is_sender) {
        using RG = RemoteGroups<kNumRanks>;
        const int peer = RG::peer_of_warp(rank);
        if (peer < 0) return;  // an idle warp (plain mapping, own group): no block-wide barrier follows
        const int warp_in_group = RG::warp_in_group();
        const bool leader = warp_in_group == 0 && lane_id() == 0;
        const int bar_id = 1 + peer;
        void* dst_base = buffer_ptrs[peer];
        int4* ring_x = layout.x.on(dst_base, channel, rank);
        float* ring_weights = layout.topk_weights.on(dst_base, channel, rank);

        const int block_begin = peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + rank] : 0;
        const int block_rows = rank_prefix_matrix[peer * kNumRanks + rank] - block_begin;
        const int owner_tokens = ld_volatile(NotifyArea().num_tokens.on(buffer_ptrs[rank]) + peer);
        int token_begin, token_end;
        channel_range(owner_tokens, num_channels, channel, token_begin, token_end);
        const int first = warp_lower_bound(recv_src_idx + block_begin, block_rows, token_begin);
        const int last = warp_lower_bound(recv_src_idx + block_begin, block_rows, token_end);
        const int row_begin = block_begin + first, row_end = block_begin + last;
        // Absolute counters: the ring starts at `first`; a head still 0 (nothing released yet) means `first`.
        const RingProducer<true> ring{layout.tail.on(dst_base, channel, rank), layout.head.on(dst_base, channel, rank),
                                      num_slots, first};
        int cached_tail = first, cached_head = first;
        for (int row = row_begin; row < row_end;) {
            const int n = min(num_max_send_tokens, row_end - row);
            if (leader) {
                bool ok = true;
                if (!ring.has_space(cached_tail, cached_head, n)) {
                    ok = ring.wait_for_space(ctx, WaitSite{kKernelCombine, kRoleSender, channel, peer}, cached_tail,
                                             cached_head, n, [&](long long& h, long long& tl, long long& ex) {
                                                 h = cached_head; tl = cached_tail; ex = n;
                                             });
                }
                s_abort[peer] = !ok;
            }
            group_sync(bar_id, RG::kThreadsPerPeer);
            if (s_abort[peer]) break;
            for (int i = warp_in_group; i < n; i += RG::kWarpsPerPeer) {
                const int slot = (cached_tail + i) % num_slots;
                warp_copy<false, kSendUnroll>(ring_x + (long long)slot * hidden_int4, x + (long long)(row + i) * hidden_int4,
                                     hidden_int4);
                if (topk_weights != nullptr)
                    for (int k = lane_id(); k < num_topk; k += kWarpSize)
                        ring_weights[slot * num_topk + k] = topk_weights[(long long)(row + i) * num_topk + k];
            }
            cached_tail += n;
            row += n;
            group_sync(bar_id, RG::kThreadsPerPeer);
            if (leader) ring.release(cached_tail);
        }
    } else {
        void* mine = buffer_ptrs[rank];
        int begin, end;
        channel_range(num_tokens, num_channels, channel, begin, end);
        const int own_row_begin = rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + rank] : 0;
        TmaCopier tma;  // only its buffer and mbarrier: the reduction needs the data in registers
        tma.init(s_tma_buf + warp_id() * kTmaChunkBytes, &s_tma_bar[warp_id()]);
        constexpr int batch = G::kWarps * kCombineTokensPerWarp;  // = the rows of s_heads
        int released = 0;  // thread r < R: slots of ring r already handed back
        for (int b = begin; b < end; b += batch) {
            const int b_end = min(b + batch, end);
            // The batch's send_head rows, staged by the whole block at once: one load latency per batch instead
            // of a chain of loads per rank before the wait and another load per token before its first copy.
            for (int i = threadIdx.x; i < (b_end - b) * kNumRanks; i += blockDim.x)
                s_heads[0][i] = send_head[(long long)b * kNumRanks + i];
            __syncthreads();
            // Thread r < R: the ring counter the batch needs, then wait for it.
            bool ok = true;
            if (threadIdx.x < kNumRanks) {
                const int r = threadIdx.x;
                int need = 0;  // the own rank's rows are in x: nothing to wait for
                for (int i = 0; i < b_end - b && r != rank; ++i) need = max(need, s_heads[i][r] + 1);
                s_need[r] = need;
                if (need > 0) {
                    const RingConsumer ring{layout.tail.on(mine, channel, r), layout.head.on(mine, channel, r)};
                    int tail = 0;
                    ok = ring.wait_for_data(ctx, WaitSite{kKernelCombine, kRoleReceiver, channel, r}, need, tail,
                                            [&](long long& h, long long& tl, long long& ex) {
                                                h = released; tl = tail; ex = need;
                                            });
                }
            }
            if (!__syncthreads_and(ok)) break;
            if (lane_id() == 0) fence_proxy_async();  // the bulk loads read what the peers wrote
            for (int t = b + warp_id(); t < b_end; t += G::kWarps) {
                // This token's row in every source: a ring slot, or for the own rank a row of x (-1: not sent
                // there); kept in shared memory to leave the registers to the loads in flight.
                volatile int* slot = s_slot[warp_id()];
                if (lane_id() < kNumRanks) {
                    const int h = s_heads[t - b][lane_id()];
                    slot[lane_id()] = h < 0 ? -1 : lane_id() == rank ? own_row_begin + h : h % num_slots;
                }
                __syncwarp();
                const int4* volatile* srcs = s_src[warp_id()];
                const auto row_of = [&](int r, int row) {
                    return (r == rank ? x : layout.x.on(mine, channel, r)) + (long long)row * hidden_int4;
                };
                const int num_src = token_sources<kNumRanks>(srcs, bias0, bias1, t, hidden_int4, slot, row_of);
                warp_sum_rows(tma, srcs, num_src, combined_x + (long long)t * hidden_int4, hidden_int4);
                const auto weight_of = [&](int r, int row, int k) {
                    return r == rank ? topk_weights[(long long)row * num_topk + k]
                                     : ld_volatile(layout.topk_weights.on(mine, channel, r) + row * num_topk + k);
                };
                if (combined_topk_weights != nullptr)
                    sum_token_weights<kNumRanks>(combined_topk_weights + (long long)t * num_topk, num_topk, slot,
                                                 weight_of);
                __syncwarp();  // the lanes are done with `slot` before the next token overwrites it
            }
            __syncthreads();  // the batch's slots are read
            if (threadIdx.x < kNumRanks && s_need[threadIdx.x] > released) {
                released = s_need[threadIdx.x];
                ring_release(layout.head.on(mine, channel, threadIdx.x), released);
            }
        }
    }
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
    using G = Groups<kNumRanks>;
    __shared__ int s_row[G::kWarps][kNumRanks];  // reducer warp: its token's row from each rank (-1: none)
    __shared__ const int4* s_src[G::kWarps][kNumRanks + 2];  // reducer warp: its token's sources, in order
    __shared__ unsigned long long s_tma_bar[G::kWarps];
    extern __shared__ __align__(128) unsigned char s_tma_buf[];  // reducers: kTmaChunkBytes per warp
    if (block_aborted(ctx)) return;
    const DirectCombineLayout layout(kNumRanks, capacity, hidden_int4, num_topk);
    // Every block of rows (expert rank, owner) must fit; every rank reads the same matrix and stops alike.
    for (int i = 0; i < kNumRanks * kNumRanks; ++i) {
        const int rows = rank_prefix_matrix[i] - (i >= kNumRanks ? rank_prefix_matrix[i - kNumRanks] : 0);
        if (rows > capacity) {
            if (blockIdx.x == 0 && threadIdx.x == 0)
                report_failure(ctx, WaitSite{kKernelCombineDirect, kRoleZeroCopyCapacity, -1, i % kNumRanks}, rows,
                               capacity, -1, 0);
            return;
        }
    }
    // The entry handshake (no notify kernel before it): block 0 zeroes the flags that rows sent to this rank can
    // use (each rank sends at most num_tokens rows back to it, one flag per rows_per_flag).
    const CallWords words{{kOpDirectCombine, 0, 0, hidden_int4, num_topk, 0, 0, capacity}};
    const int epoch = open_direct_call<kNumRanks>(buffer_ptrs, rank, words, layout.begin,
                                                  layout.begin + min((long long)num_tokens, layout.capacity) * kNumRanks * 4);
    if (!wait_direct_call<kNumRanks>(buffer_ptrs, rank, words, epoch, ctx, kKernelCombineDirect)) return;

    if ((int)blockIdx.x < num_sender_blocks) {
        const int warp = (int)blockIdx.x * G::kWarps + warp_id(), num_warps = num_sender_blocks * G::kWarps;
        int chunk_base = 0;  // chunks of the owners before this one (the warps deal all owners' chunks in turn)
        for (int step = 1; step < kNumRanks; ++step) {
            const int owner = (rank + step) % kNumRanks;
            const int first = owner > 0 ? rank_prefix_matrix[(owner - 1) * kNumRanks + rank] : 0;
            const int num_rows = rank_prefix_matrix[owner * kNumRanks + rank] - first;
            const int num_chunks = (num_rows + rows_per_flag - 1) / rows_per_flag;
            void* dst = buffer_ptrs[owner];
            int4* rows = layout.x.on(dst) + (long long)rank * capacity * hidden_int4;
            float* weights = layout.topk_weights.on(dst) + (long long)rank * capacity * num_topk;
            int* flags = layout.flags.on(dst) + rank;  // flag k at k * kNumRanks
            for (int k = ((warp - chunk_base) % num_warps + num_warps) % num_warps; k < num_chunks; k += num_warps) {
                const int j_end = min((k + 1) * rows_per_flag, num_rows);
                for (int j = k * rows_per_flag; j < j_end; ++j) {
                    warp_copy<false, kSendUnroll>(rows + (long long)j * hidden_int4,
                                                  x + (long long)(first + j) * hidden_int4, hidden_int4);
                    if (topk_weights != nullptr)
                        for (int i = lane_id(); i < num_topk; i += kWarpSize)
                            weights[(long long)j * num_topk + i] = topk_weights[(long long)(first + j) * num_topk + i];
                }
                __syncwarp();  // the lanes' stores are ordered before lane 0's release
                if (lane_id() == 0) st_release_sys(flags + (long long)k * kNumRanks, 1);
            }
            chunk_base += num_chunks;
        }
        return;
    }

    // Reducers: all reducer warps walk the tokens together (token t goes to reducer warp t % their count), in
    // the order the senders' chunks land (row order), so no reducer waits for rows that come last while others
    // idle (contiguous shares per block measured 494 us against 260 for the ring combine at 24 SMs).
    const int num_reducer_warps = ((int)gridDim.x - num_sender_blocks) * G::kWarps;
    const int reducer_warp = ((int)blockIdx.x - num_sender_blocks) * G::kWarps + warp_id();
    const int own_first = rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + rank] : 0;
    void* mine = buffer_ptrs[rank];
    const int4* inbox = layout.x.on(mine);
    const float* inbox_weights = layout.topk_weights.on(mine);
    TmaCopier tma;  // only its buffer and mbarrier: the reduction needs the data in registers
    tma.init(s_tma_buf + warp_id() * kTmaChunkBytes, &s_tma_bar[warp_id()]);
    for (int t = reducer_warp; t < num_tokens; t += num_reducer_warps) {
        bool ok = true;
        if (lane_id() < kNumRanks) {
            const int r = lane_id();
            int row = send_head[(long long)t * kNumRanks + r];
            if (row >= 0 && r != rank) {
                const int* flag = layout.flags.on(mine) + (long long)(row / rows_per_flag) * kNumRanks + r;
                ok = wait_until(ctx, WaitSite{kKernelCombineDirect, kRoleReceiver, t, r},
                                [&] { return ld_acquire_sys(flag) != 0; },
                                [&](long long& h, long long& tl, long long& ex) { h = row; tl = 0; ex = 1; });
            }
            s_row[warp_id()][r] = row;
        }
        if (!__all_sync(0xffffffffu, ok)) return;  // the buffer is stopped; no block barrier follows
        const volatile int* rows = s_row[warp_id()];
        if (lane_id() == 0) fence_proxy_async();  // the bulk loads read what the peers wrote (acquired above)
        const int4* volatile* srcs = s_src[warp_id()];
        const auto row_of = [&](int r, int row) {
            return r == rank ? x + (long long)(own_first + row) * hidden_int4
                             : inbox + ((long long)r * capacity + row) * hidden_int4;
        };
        const int num_src = token_sources<kNumRanks>(srcs, bias0, bias1, t, hidden_int4, rows, row_of);
        warp_sum_rows(tma, srcs, num_src, combined_x + (long long)t * hidden_int4, hidden_int4);
        const auto weight_of = [&](int r, int row, int k) {
            return r == rank ? topk_weights[(long long)(own_first + row) * num_topk + k]
                             : ld_volatile(inbox_weights + ((long long)r * capacity + row) * num_topk + k);
        };
        if (combined_topk_weights != nullptr)
            sum_token_weights<kNumRanks>(combined_topk_weights + (long long)t * num_topk, num_topk, rows, weight_of);
        __syncwarp();  // the lanes are done with s_row before the next token overwrites it
    }
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
