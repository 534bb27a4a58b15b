// internode/dispatch.cuh: internode_dispatch's roles. A DispatchContext holds one block's view of the call (the
// kernel's arguments and what every role derives from them); each role is its member function, the block's role
// map is dispatch_role_of.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "common/lock.cuh"
#include "common/ring.cuh"
#include "internode/roles.cuh"
#include "internode/rdma_ring.cuh"

namespace ep::internode {

// The dispatch's shared memory: per destination node the senders' in-order release (lock, window of slots
// written, released count the coordinator reads); per forwarder warp and source node the slots consumed, and
// whether the warp is done.
struct DispatchShared {
    int lock[kMaxRdmaRanks], released[kMaxRdmaRanks];
    unsigned window[kMaxRdmaRanks];
    int fwd_head[kMaxNvlRanks][kMaxRdmaRanks];
    int retired[kMaxNvlRanks];
};

// Channel c = SM pair (2c, 2c+1). Odd SM: kRDMASender x S, kRDMASenderCoordinator, kNVLReceivers x G; even SM:
// kRDMAAndNVLForwarder x G, kForwarderCoordinator; target: the GPU index j of the NVLink roles.
template <int kNumNvlRanks>
__device__ __forceinline__ RoleOf dispatch_role_of(int sm, int warp) {
    constexpr int S = kDispatchSenderWarps, G = kNumNvlRanks;
    if (sm % 2 == 1) {
        if (warp < S) return {kRDMASender, warp};
        if (warp == S) return {kRDMASenderCoordinator, 0};
        if (warp < S + 1 + G) return {kNVLReceivers, warp - S - 1};
    } else {
        if (warp < G) return {kRDMAAndNVLForwarder, warp};
        if (warp == G) return {kForwarderCoordinator, 0};
    }
    return {kIdle, 0};
}

template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma, typename IdxT>
struct DispatchContext {
    static constexpr int N = kNumRdmaRanks, G = kNumNvlRanks, R = N * G, S = kDispatchSenderWarps;
    // the kernel's arguments, in its order
    int4* recv_x;
    float* recv_x_scales;
    IdxT* recv_topk_idx;
    float* recv_topk_weights;
    int2* recv_src_meta;
    int* recv_rdma_channel_prefix_matrix;
    int* recv_gbl_channel_prefix_matrix;
    int* send_rdma_head;
    int* send_nvl_head;
    const int4* x;
    const float* x_scales;
    const IdxT* topk_idx;
    const float* topk_weights;
    const bool* is_token_in_rank;
    const int* rdma_channel_prefix_matrix;
    const int* recv_rdma_rank_prefix_sum;
    const int* gbl_channel_prefix_matrix;
    const int* recv_gbl_rank_prefix_sum;
    int num_tokens;
    int num_worst_tokens;
    int hidden_int4;
    int num_topk;
    int num_experts;
    int num_scales;
    long long scale_token_stride;
    long long scale_hidden_stride;
    void** nvl_ptrs;
    char* rdma_base;
    const unsigned long long* rdma_peers;
    int rank;
    int num_rdma_send;
    int num_rdma_slots;
    int num_nvl_send;
    int num_nvl_slots;
    const DeviceCtx* ctx;
    DispatchShared& sh;
    // derived
    int node = rank / G, nvl_rank = rank % G;
    int num_channels = gridDim.x / 2, channel = blockIdx.x / 2;
    int warp = warp_id(), lane = lane_id();
    Rdma rdma = Rdma(RdmaArgs{rdma_base, rdma_peers, node});
    TokenFormat fmt = TokenFormat(hidden_int4, num_scales, num_topk, true);
    InternodeDispatchRdma rl = InternodeDispatchRdma(N, G, num_channels, num_rdma_slots, fmt.int4s);
    InternodeDispatchNvl nl = InternodeDispatchNvl(N, G, num_channels, num_nvl_slots, fmt.int4s);
    void* my_nvl = nvl_ptrs[nvl_rank];

    // Block-wide, before the roles: the shared state zeroed; rows past the real count carry recv_topk_idx = -1
    // (num_worst_tokens; nobody else writes them).
    __device__ __forceinline__ void prepare() const {
        for (int i = threadIdx.x; i < kMaxRdmaRanks; i += blockDim.x) sh.lock[i] = sh.released[i] = sh.window[i] = 0;
        for (int i = threadIdx.x; i < kMaxNvlRanks * kMaxRdmaRanks; i += blockDim.x)
            sh.fwd_head[i / kMaxRdmaRanks][i % kMaxRdmaRanks] = 0;
        for (int i = threadIdx.x; i < kMaxNvlRanks; i += blockDim.x) sh.retired[i] = 0;
        // num_worst_tokens: rows past the real count carry recv_topk_idx = -1 (nobody else writes them).
        if (num_worst_tokens > 0 && recv_topk_idx != nullptr) {
            const long long num_recv = recv_gbl_rank_prefix_sum[R - 1];
            const long long stride = (long long)gridDim.x * blockDim.x;
            for (long long i = num_recv * num_topk + (long long)blockIdx.x * blockDim.x + threadIdx.x;
                 i < (long long)num_worst_tokens * num_topk; i += stride)
                recv_topk_idx[i] = (IdxT)-1;
        }
    }

    // kRDMASender (odd SM, warps 0 .. S-1): token t of the channel by warp (t - begin) % S, into its slot
    // of every destination node's RDMA ring, released in order through the node's window under its lock.
    __device__ __forceinline__ void rdma_sender() const {
        int begin, end;
        channel_range(num_tokens, num_channels, channel, begin, end);
        // Meta for every destination node (-v-1 encoded: 0 keeps meaning "not written yet").
        for (int n = warp; n < N; n += S) {
            int* meta = n == node ? rl.meta.recv(rdma_base, channel, node) : rl.meta.send(rdma_base, channel, n);
            const int prev = channel - 1;
            if (lane < G) {
                const int* row = gbl_channel_prefix_matrix + (n * G + lane) * num_channels;
                meta[lane] = -(prev >= 0 ? row[prev] : 0) - 1;
                meta[G + lane] = -row[channel] - 1;
            }
            if (lane == 0) {
                const int* row = rdma_channel_prefix_matrix + n * num_channels;
                meta[2 * G] = -(prev >= 0 ? row[prev] : 0) - 1;
                meta[2 * G + 1] = -row[channel] - 1;
            }
            __syncwarp();
            if (n != node) {
                fence_acq_rel_sys();
                rdma.put_warp(offset_in(rdma_base, rl.meta.recv(rdma_base, channel, node)), meta,
                              4LL * rdma_meta_ints(G), n);
            }
        }
        __syncwarp();
        if (lane == 0 && warp < N) rdma.quiet();  // every put of this kernel completes inside it
        // Every sender warp scans every token so that lane n knows the node-n ring counter (`tail`).
        int tail = 0, cached_head = 0;  // lane n < N
        // node n's ring: its tail is published by the coordinator (rdma_publish_slots)
        const RingProducer<> ring{nullptr, rl.head.on(rdma_base, channel, lane < N ? lane : 0), num_rdma_slots};
        const SharedLock window_lock{&sh.lock[lane < N ? lane : 0]};
        bool ok = true;
        for (int t = begin; t < end && ok; ++t) {
            unsigned bits = 0;
            if (lane < N) {
#pragma unroll
                for (int j = 0; j < G; ++j) bits |= is_token_in_rank[(long long)t * R + lane * G + j] ? (1u << j) : 0u;
            }
            const bool in_node = bits != 0;
            const unsigned node_mask = __ballot_sync(kFullMask, in_node);
            if ((t - begin) % S == warp) {
                if (lane < N && send_rdma_head != nullptr)
                    send_rdma_head[(long long)t * N + lane] = in_node ? tail : -1;
                ok = ring.wait_for_space<kByWarpAll>(
                    ctx, WaitSite{kKernelInternodeDispatch, kRDMASender, channel, lane}, tail, cached_head, 1,
                    [&](long long& h, long long& tl, long long& e) {
                        h = cached_head;
                        tl = tail;
                        e = num_rdma_slots;
                    },
                    in_node);
                if (!ok) break;
                for (unsigned m = node_mask; m != 0; m &= m - 1) {
                    const int n = __ffs(m) - 1;
                    const int slot = __shfl_sync(kFullMask, tail, n) % num_rdma_slots;
                    const unsigned n_bits = __shfl_sync(kFullMask, bits, n);
                    int4* token = rdma_ring_for(rdma, rl.data, channel, node, n) + (long long)slot * fmt.int4s;
                    char* tb = reinterpret_cast<char*>(token);
                    warp_copy<false, kCopyUnroll>(token, x + (long long)t * hidden_int4, hidden_int4);
                    for (int s = lane; s < num_scales; s += kWarpSize)
                        reinterpret_cast<float*>(tb + fmt.scales_off)[s] =
                            x_scales[t * scale_token_stride + s * scale_hidden_stride];
                    if (lane == 0) *reinterpret_cast<int2*>(tb + fmt.meta_off) = make_int2(node, (int)n_bits);
                    for (int k = lane; k < num_topk; k += kWarpSize) {
                        reinterpret_cast<int*>(tb + fmt.idx_off)[k] =
                            topk_idx != nullptr ? (int)topk_idx[(long long)t * num_topk + k] : -1;
                        reinterpret_cast<float*>(tb + fmt.weights_off)[k] =
                            topk_weights != nullptr ? topk_weights[(long long)t * num_topk + k] : 0.0f;
                    }
                }
                __syncwarp();
                // Release in order: lane n marks its slot in node n's window; the run of ready slots at the
                // window's start moves sh.released, which the coordinator reads.
                bool released = true;
                if (in_node) {
                    __threadfence_block();
                    released = wait_until(
                        ctx, WaitSite{kKernelInternodeDispatch, kRDMASender, channel, lane},
                        [&] { return tail - ld_shared_volatile(&sh.released[lane]) < kSendWindow; },
                        [&](long long& h, long long& tl, long long& e) {
                            h = ld_shared_volatile(&sh.released[lane]);
                            tl = tail;
                            e = kSendWindow;
                        });
                    released = released &&
                               window_lock.acquire(ctx, WaitSite{kKernelInternodeDispatch, kRDMASender, channel, lane});
                    if (released) {
                        const int offset = tail - sh.released[lane];
                        unsigned window = sh.window[lane] | (1u << offset);
                        if (offset == 0) {
                            const int run = window == kFullMask ? 32 : __ffs(~window) - 1;
                            window = run == 32 ? 0u : window >> run;
                            st_shared_volatile(&sh.released[lane], sh.released[lane] + run);
                        }
                        sh.window[lane] = window;
                        window_lock.release();
                    }
                }
                ok = __all_sync(kFullMask, released) != 0;
            }
            if (in_node) ++tail;
        }
    }

    // kRDMASenderCoordinator (odd SM, warp S): the released slots of each node in chunks: put
    // (where stores do not reach the node) and tail add.
    __device__ __forceinline__ void rdma_sender_coordinator() const {
        int total = 0, issued = 0;  // lane n < N
        if (lane < N) {
            const int* row = rdma_channel_prefix_matrix + lane * num_channels;
            total = row[channel] - (channel > 0 ? row[channel - 1] : 0);
        }
        int ready = 0;
        while (__any_sync(kFullMask, issued < total)) {
            const bool ok = warp_wait_any(
                ctx, WaitSite{kKernelInternodeDispatch, kRDMASenderCoordinator, channel, lane},
                [&] {
                    ready = issued < total ? ld_shared_volatile(&sh.released[lane < N ? lane : 0]) - issued : 0;
                    return ready >= num_rdma_send || (ready > 0 && issued + ready == total);
                },
                [&](long long& h, long long& tl, long long& e) {
                    h = issued;
                    tl = issued + ready;
                    e = total;
                });
            if (!ok) break;
            int count = 0;
            if (ready >= num_rdma_send || (ready > 0 && issued + ready == total))
                count = min(min(ready, num_rdma_send), num_rdma_slots - issued % num_rdma_slots);
            // Ordering of a slot written straight into its receive half (own node, direct peer), and of the send
            // half a put reads: the sender warp's stores -> __syncwarp + __threadfence_block + sh.released (shared,
            // same CTA) -> lane n of this warp observes sh.released -> fence.acq_rel.sys below -> __syncwarp ->
            // lane 0's rdma.fence() (a system-scope fence on both transports) -> the atomic tail add, which the
            // consumer acquires. Causality order is transitive, so the consumer sees the slot wherever it was
            // stored; a put only adds its own data, ordered by rdma.fence().
            fence_acq_rel_sys();
            for (unsigned m = __ballot_sync(kFullMask, count > 0); m != 0; m &= m - 1) {
                const int n = __ffs(m) - 1;
                const int cnt = __shfl_sync(kFullMask, count, n);
                const int first = __shfl_sync(kFullMask, issued, n) % num_rdma_slots;
                rdma_publish_slots(rdma, rl.data, rl.tail, channel, node, n, first, cnt, fmt.int4s, fmt.bytes);
            }
            issued += count;
        }
        __syncwarp();
        if (lane == 0) rdma.quiet();
    }

    // kNVLReceivers (odd SM, warps S+1 .. S+G): warp j drains forwarder GPU j's NVLink ring into recv_x.
    __device__ __forceinline__ void nvl_receivers(int j) const {
        int start = 0, stop = 0;
        const int* start_ptr = nl.prefix_start.on(my_nvl, channel, j);
        const int* end_ptr = nl.prefix_end.on(my_nvl, channel, j);
        bool ok = warp_wait_all(
            ctx, WaitSite{kKernelInternodeDispatch, kNVLReceivers, channel, j},
            [&] {
                if (lane >= N) return true;
                start = ld_volatile(start_ptr + lane);
                stop = ld_volatile(end_ptr + lane);
                return start != 0 && stop != 0;
            },
            [&](long long& h, long long& tl, long long& e) {
                h = start;
                tl = stop;
                e = -1;
            });
        int next_row = 0, count = 0;  // lane n: next output row of source rank (n, j)
        if (ok && lane < N) {
            start = -start - 1;
            stop = -stop - 1;
            const int src = lane * G + j;
            next_row = (src > 0 ? recv_gbl_rank_prefix_sum[src - 1] : 0) + start;
            count = stop - start;
            if (recv_gbl_channel_prefix_matrix != nullptr)
                recv_gbl_channel_prefix_matrix[src * num_channels + channel] = next_row;
        }
        const int num_to_recv = warp_reduce_sum(count);
        const int experts_per_rank = num_experts / R;
        const int4* ring = nl.x.on(my_nvl, channel, j);
        const RingConsumer counters{nl.tail.on(my_nvl, channel, j), nl.head.on(nvl_ptrs[j], channel, nvl_rank)};
        int head = 0;
        while (ok && head < num_to_recv) {
            int tl = head;
            ok = counters.wait_for_data<kByWarpAll>(ctx, WaitSite{kKernelInternodeDispatch, kNVLReceivers, channel, j},
                                                    head + 1, tl, [&](long long& h, long long& t2, long long& e) {
                                                        h = head;
                                                        t2 = tl;
                                                        e = num_to_recv;
                                                    });
            if (!ok) break;
            // Every lane loaded the tail itself; take lane 0's value so that the token loop below
            // (full-mask __shfl_sync inside) has one trip count for the whole warp even if the loads differed;
            // __syncwarp orders lane 0's acquire before every lane's slot loads.
            __syncwarp();
            tl = __shfl_sync(kFullMask, tl, 0);
            for (int i = head; i < tl; ++i) {
                const char* tb = reinterpret_cast<const char*>(ring + (long long)(i % num_nvl_slots) * fmt.int4s);
                const int src_node = ld_volatile(reinterpret_cast<const int*>(tb + fmt.meta_off));
                const int src_bits = ld_volatile(reinterpret_cast<const int*>(tb + fmt.meta_off) + 1);
                const long long row = __shfl_sync(kFullMask, next_row, src_node);
                if (lane == src_node) ++next_row;
                warp_copy<true, kCopyUnroll>(recv_x + row * hidden_int4, reinterpret_cast<const int4*>(tb),
                                             hidden_int4);
                for (int s = lane; s < num_scales; s += kWarpSize)
                    recv_x_scales[row * num_scales + s] =
                        ld_volatile(reinterpret_cast<const float*>(tb + fmt.scales_off) + s);
                if (lane == 0 && recv_src_meta != nullptr) recv_src_meta[row] = make_int2(src_node, src_bits);
                if (recv_topk_idx != nullptr) {
                    for (int k = lane; k < num_topk; k += kWarpSize) {
                        const int e = ld_volatile(reinterpret_cast<const int*>(tb + fmt.idx_off) + k);
                        const int local = e - rank * experts_per_rank;
                        const bool owned = e >= 0 && local >= 0 && local < experts_per_rank;
                        recv_topk_idx[row * num_topk + k] = (IdxT)(owned ? local : -1);
                        recv_topk_weights[row * num_topk + k] =
                            owned ? ld_volatile(reinterpret_cast<const float*>(tb + fmt.weights_off) + k) : 0.0f;
                    }
                }
            }
            head = tl;
            __syncwarp();
            if (lane == 0) counters.release(head);
        }
    }

    // kRDMAAndNVLForwarder (even SM, warps 0 .. G-1): warp j forwards every RDMA token meant for GPU j
    // of my node into GPU j's NVLink ring.
    __device__ __forceinline__ void rdma_and_nvl_forwarder(int j) const {
        const int* meta = rl.meta.recv(rdma_base, channel, lane < N ? lane : 0);
        bool ok = warp_wait_all(
            ctx, WaitSite{kKernelInternodeDispatch, kRDMAAndNVLForwarder, channel, lane},
            [&] {
                return lane >= N || (ld_volatile(meta + j) < 0 && ld_volatile(meta + G + j) < 0 &&
                                     ld_volatile(meta + 2 * G) < 0 && ld_volatile(meta + 2 * G + 1) < 0);
            },
            [&](long long& h, long long& tl, long long& e) {
                h = ld_volatile(meta + j);
                e = -1;
            });
        int consumed = 0, num_rdma = 0, forwarded = 0, row_base = 0;  // lane n: source node n
        if (ok && lane < N) {
            st_relaxed_sys(nl.prefix_start.on(nvl_ptrs[j], channel, nvl_rank) + lane, ld_volatile(meta + j));
            st_relaxed_sys(nl.prefix_end.on(nvl_ptrs[j], channel, nvl_rank) + lane, ld_volatile(meta + G + j));
            const int rdma_start = -ld_volatile(meta + 2 * G) - 1, rdma_end = -ld_volatile(meta + 2 * G + 1) - 1;
            num_rdma = rdma_end - rdma_start;
            row_base = (lane > 0 ? recv_rdma_rank_prefix_sum[lane - 1] : 0) + rdma_start;
            if (j == 0 && recv_rdma_channel_prefix_matrix != nullptr)
                recv_rdma_channel_prefix_matrix[lane * num_channels + channel] = rdma_end;
        }
        // consumer of node n's RDMA ring (lane n; its head goes back through the coordinator), producer of GPU j's
        // NVLink ring (the whole warp)
        const RingConsumer rdma_ring{rl.tail.on(rdma_base, channel, lane < N ? lane : 0), nullptr};
        const RingProducer<> nvl{nl.tail.on(nvl_ptrs[j], channel, nvl_rank), nl.head.on(my_nvl, channel, j),
                                 num_nvl_slots};
        int4* nvl_ring = nl.x.on(nvl_ptrs[j], channel, nvl_rank);
        int nvl_tail = 0, nvl_head = 0, rr = 0, avail = 0;
        while (ok && __any_sync(kFullMask, consumed < num_rdma)) {
            ok = nvl.wait_for_space<kByWarpAll>(
                ctx, WaitSite{kKernelInternodeDispatch, kRDMAAndNVLForwarder, channel, N + j}, nvl_tail, nvl_head,
                num_nvl_send, [&](long long& h, long long& tl, long long& e) {
                    h = nvl_head;
                    tl = nvl_tail;
                    e = num_nvl_send;
                });
            int rdma_tail = consumed;
            ok = ok && rdma_ring.wait_for_data<kByWarpAny>(
                           ctx, WaitSite{kKernelInternodeDispatch, kRDMAAndNVLForwarder, channel, lane}, consumed + 1,
                           rdma_tail,
                           [&](long long& h, long long& tl, long long& e) {
                               h = consumed;
                               tl = rdma_tail;
                               e = num_rdma;
                           },
                           lane < N && consumed < num_rdma);
            avail = min(rdma_tail, num_rdma) - consumed;
            if (!ok) break;
            // Only lane n acquired node n's tail; ballot/shfl are not memory-ordering operations, so
            // the other lanes' slot loads below are ordered after that acquire by this warp barrier.
            __syncwarp();
            const unsigned mask = __ballot_sync(kFullMask, lane < N && consumed < num_rdma && avail > 0);
            const int n = next_set_bit(mask, rr);
            rr = n + 1 < N ? n + 1 : 0;
            const int cnt = __shfl_sync(kFullMask, avail, n), first = __shfl_sync(kFullMask, consumed, n);
            const int base_row = __shfl_sync(kFullMask, row_base, n);
            int fwd = __shfl_sync(kFullMask, forwarded, n);
            const int4* src_ring = rl.data.recv(rdma_base, channel, n);
            int used = 0, sent = 0;
            for (; used < cnt && sent < num_nvl_send; ++used) {
                const int4* token = src_ring + (long long)((first + used) % num_rdma_slots) * fmt.int4s;
                const int bits =
                    ld_volatile(reinterpret_cast<const int*>(reinterpret_cast<const char*>(token) + fmt.meta_off) + 1);
                const bool to_j = (bits >> j) & 1;
                if (lane == 0 && send_nvl_head != nullptr)
                    send_nvl_head[(long long)(base_row + first + used) * G + j] = to_j ? fwd : -1;
                if (to_j) {
                    warp_copy<true, kCopyUnroll>(nvl_ring + (long long)(nvl_tail % num_nvl_slots) * fmt.int4s, token,
                                                 fmt.int4s);
                    ++nvl_tail;
                    ++fwd;
                    ++sent;
                }
            }
            __syncwarp();
            if (lane == 0) nvl.release(nvl_tail);
            if (lane == n) {
                consumed += used;
                forwarded = fwd;
                __threadfence_block();  // my reads of the slots before the coordinator may return them
                st_shared_volatile(&sh.fwd_head[j][n], consumed);
            }
        }
        __syncwarp();
        if (lane == 0) {
            __threadfence_block();
            st_shared_volatile(&sh.retired[j], 1);
        }
    }

    // kForwarderCoordinator (even SM, warp G): returns the RDMA heads, lazily (lane n: source node n).
    __device__ __forceinline__ void forwarder_coordinator() const {
        int returned = 0, min_head = 0;
        while (true) {
            bool all_retired = false;
            const bool ok = warp_wait_any(
                ctx, WaitSite{kKernelInternodeDispatch, kForwarderCoordinator, channel, lane},
                [&] {
                    all_retired = true;
                    for (int w = 0; w < G; ++w) all_retired &= ld_shared_volatile(&sh.retired[w]) != 0;
                    __threadfence_block();
                    min_head = 0x7fffffff;
                    for (int w = 0; w < G; ++w)
                        min_head = min(min_head, ld_shared_volatile(&sh.fwd_head[w][lane < N ? lane : 0]));
                    return all_retired || (lane < N && min_head - returned >= num_rdma_send);
                },
                [&](long long& h, long long& tl, long long& e) {
                    h = returned;
                    tl = min_head;
                    e = num_rdma_send;
                });
            if (!ok) break;
            all_retired = __all_sync(kFullMask, all_retired) != 0;
            if (lane < N && min_head > returned && (all_retired || min_head - returned >= num_rdma_send)) {
                rdma.add(offset_in(rdma_base, rl.head.on(rdma_base, channel, node)), min_head - returned, lane);
                returned = min_head;
            }
            if (all_retired) break;
        }
        if (lane < N) rdma.quiet();
    }
};

}  // namespace ep::internode
