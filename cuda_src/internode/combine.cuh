// internode/combine.cuh: internode_combine's roles, as member functions of its CombineContext (one block's view of
// the call); the block's role map is combine_role_of.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "common/ring.cuh"
#include "internode/roles.cuh"
#include "internode/reduce.cuh"
#include "internode/rdma_ring.cuh"

namespace ep::internode {

// The combine's shared memory: the RDMA receivers' next token per warp (the coordinator's progress), and per
// reducing warp and source the source row's offset (int4) from the first source's ring, or -1 (in shared memory so
// that the reductions keep one base pointer in registers instead of one per source).
template <int kNumRdmaRanks, int kNumNvlRanks>
struct CombineShared {
    int next[kCombineRecvWarps];
    long long slot[CombineShape<kNumRdmaRanks, kNumNvlRanks>::kWarps][kMaxRdmaRanks];
};

// Channel c = SM pair (2c, 2c+1). Even SM: kNVLSender x G (target: the forwarder GPU k), kRDMAReceiver x
// kCombineRecvWarps (target: its index w), kCoordinator; odd SM: kNVLAndRDMAForwarder (one warp per origin node up to
// kMaxCombineForwarderWarps; target: the warp, which serves nodes target, target + kOddWarps, ...).
template <int kNumRdmaRanks, int kNumNvlRanks>
__device__ __forceinline__ RoleOf combine_role_of(int sm, int warp) {
    constexpr int G = kNumNvlRanks, W = kCombineRecvWarps;
    if (sm % 2 == 0) {
        if (warp < G) return {kNVLSender, warp};
        if (warp < G + W) return {kRDMAReceiver, warp - G};
        if (warp == G + W) return {kCoordinator, 0};
    } else if (warp < CombineShape<kNumRdmaRanks, kNumNvlRanks>::kOddWarps) {
        return {kNVLAndRDMAForwarder, warp};
    }
    return {kIdle, 0};
}

template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma>
struct CombineContext {
    static constexpr int N = kNumRdmaRanks, G = kNumNvlRanks, W = kCombineRecvWarps;
    // the kernel's arguments, in its order
    int4* combined_x;
    float* combined_topk_weights;
    const int4* x;
    const float* topk_weights;
    const int4* bias0;
    const int4* bias1;
    const int* recv_gbl_channel_prefix_matrix;
    const int* recv_gbl_rank_prefix_sum;
    const int* recv_rdma_channel_prefix_matrix;
    const int* recv_rdma_rank_prefix_sum;
    const int* send_rdma_head;
    const int* send_nvl_head;
    int num_tokens;
    int hidden_int4;
    int num_topk;
    void** nvl_ptrs;
    char* rdma_base;
    const unsigned long long* rdma_peers;
    int rank;
    int num_rdma_send;
    int num_rdma_slots;
    int num_nvl_send;
    int num_nvl_slots;
    const DeviceCtx* ctx;
    CombineShared<kNumRdmaRanks, kNumNvlRanks>& sh;
    // derived
    int node = rank / G, nvl_rank = rank % G;
    int num_channels = gridDim.x / 2, channel = blockIdx.x / 2;
    int warp = warp_id(), lane = lane_id();
    Rdma rdma = Rdma(RdmaArgs{rdma_base, rdma_peers, node});
    TokenFormat fmt = TokenFormat(hidden_int4, 0, num_topk, false);
    InternodeCombineRdma rl = InternodeCombineRdma(N, G, num_channels, num_rdma_slots, fmt.int4s);
    InternodeCombineNvl nl = InternodeCombineNvl(N, G, num_channels, num_nvl_slots, fmt.int4s);
    void* my_nvl = nvl_ptrs[nvl_rank];
    int sub_slots = num_nvl_slots / N;                                // NVLink sub-ring per origin node
    int2 tokens = channel_bounds(num_tokens, num_channels, channel);  // my tokens [begin, end) of this channel
    int begin = tokens.x, end = tokens.y;

    // Block-wide, before the roles.
    __device__ __forceinline__ void prepare() const {
        for (int i = threadIdx.x; i < W; i += blockDim.x) sh.next[i] = begin + i;
    }

    // kNVLSender (even SM, warps 0 .. G-1): warp k sends my rows that came through forwarder GPU k back to it,
    // into the sub-ring of the token's origin node.
    __device__ __forceinline__ void nvl_sender(int k) const {
        int row = 0, row_end = 0, sent = 0;  // lane n: rows of source rank (n, k) in this channel
        if (lane < N) {
            const int src = lane * G + k;
            row = recv_gbl_channel_prefix_matrix[src * num_channels + channel];
            row_end = channel + 1 < num_channels ? recv_gbl_channel_prefix_matrix[src * num_channels + channel + 1]
                                                 : recv_gbl_rank_prefix_sum[src];
        }
        int4* ring = nl.x.on(nvl_ptrs[k], channel, nvl_rank);
        int* tail_ptr = nl.tail.on(nvl_ptrs[k], channel, nvl_rank);
        // lane n: producer of the sub-ring of origin node n
        const RingProducer<> sub{tail_ptr + lane, nl.head.on(my_nvl, channel, k) + lane, sub_slots};
        int rr = 0, head = 0;
        bool ok = true;
        while (ok && __any_sync(kFullMask, row < row_end)) {
            ok = sub.wait_for_space<kByWarpAny, false>(
                ctx, WaitSite{kKernelInternodeCombine, kNVLSender, channel, lane}, sent, head,
                min(num_nvl_send, row_end - row),
                [&](long long& h, long long& tl, long long& e) {
                    h = head;
                    tl = sent;
                    e = sub_slots;
                },
                lane < N && row < row_end);
            if (!ok) break;
            const bool ready = lane < N && row < row_end && sub.has_space(sent, head, min(num_nvl_send, row_end - row));
            const int n = next_set_bit(__ballot_sync(kFullMask, ready), rr);
            rr = n + 1 < N ? n + 1 : 0;
            const int r0 = __shfl_sync(kFullMask, row, n), s0 = __shfl_sync(kFullMask, sent, n);
            const int cnt = min(num_nvl_send, __shfl_sync(kFullMask, row_end, n) - r0);
            for (int i = 0; i < cnt; ++i) {
                int4* token = ring + (long long)(n * sub_slots + (s0 + i) % sub_slots) * fmt.int4s;
                warp_copy<false, kCopyUnroll>(token, x + (long long)(r0 + i) * hidden_int4, hidden_int4);
                for (int kk = lane; kk < num_topk; kk += kWarpSize)
                    reinterpret_cast<float*>(reinterpret_cast<char*>(token) + fmt.weights_off)[kk] =
                        topk_weights != nullptr ? topk_weights[(long long)(r0 + i) * num_topk + kk] : 0.0f;
            }
            __syncwarp();
            if (lane == 0) ring_release(tail_ptr + n, s0 + cnt);  // sub-ring n's tail (lane n's ring)
            if (lane == n) {
                row += cnt;
                sent += cnt;
            }
        }
    }

    // kRDMAReceiver (even SM, warps G .. G+W-1): warp w reduces my tokens begin + w, begin + w + W, ... over
    // the nodes that hold a partial sum of them.
    __device__ __forceinline__ void rdma_receiver(int w) const {
        long long* slot = sh.slot[warp];
        const int4* ring0 = rl.data.recv(rdma_base, channel, 0);  // source n's ring: + n * elems_per_rank
        for (int t = begin + w; t < end; t += W) {
            const int h = lane < N ? send_rdma_head[(long long)t * N + lane] : -1;
            int seen = 0;
            const bool ok = RingConsumer{rl.tail.on(rdma_base, channel, lane), nullptr}.wait_for_data<kByWarpAll>(
                ctx, WaitSite{kKernelInternodeCombine, kRDMAReceiver, channel, lane}, h + 1, seen,
                [&](long long& hh, long long& tl, long long& e) {
                    hh = h;
                    tl = ld_volatile(rl.tail.on(rdma_base, channel, lane));
                    e = h + 1;
                },
                h >= 0);
            if (!ok) break;
            if (lane < N)
                slot[lane] = h >= 0 ? lane * rl.data.elems_per_rank + (long long)(h % num_rdma_slots) * fmt.int4s : -1;
            __syncwarp();
            const long long row = (long long)t * hidden_int4;
            reduce_rows<N>(combined_x + row, ring0, slot, bias0 != nullptr ? bias0 + row : nullptr,
                           bias1 != nullptr ? bias1 + row : nullptr, hidden_int4);
            if (combined_topk_weights != nullptr) {
                for (int kk = lane; kk < num_topk; kk += kWarpSize)
                    combined_topk_weights[(long long)t * num_topk + kk] =
                        sum_token_weight<N>(ring0, slot, fmt.weights_off, kk);
            }
            __syncwarp();
            if (lane == 0) {
                __threadfence_block();  // the slot reads before the coordinator may return them
                st_shared_volatile(&sh.next[w], t + W);
            }
        }
        __syncwarp();
        if (lane == 0) st_shared_volatile(&sh.next[w], end);  // retired (also after a failed wait)
    }

    // kCoordinator (even SM, warp G+W): every token below min(next) is fully reduced; lane n returns node n's
    // RDMA slots, lazily.
    __device__ __forceinline__ void coordinator() const {
        int cursor = begin, released = 0, returned = 0, tmin = begin;
        while (true) {
            const bool ok = warp_wait_any(
                ctx, WaitSite{kKernelInternodeCombine, kCoordinator, channel, lane},
                [&] {
                    tmin = 0x7fffffff;
                    for (int w = 0; w < W; ++w) tmin = min(tmin, ld_shared_volatile(&sh.next[w]));
                    return tmin > cursor || tmin >= end;
                },
                [&](long long& h, long long& tl, long long& e) {
                    h = cursor;
                    tl = tmin;
                    e = end;
                });
            if (!ok) break;
            tmin = min(__shfl_sync(kFullMask, tmin, 0), end);
            if (lane < N) {
                for (int t = cursor; t < tmin; ++t) {
                    const int h = send_rdma_head[(long long)t * N + lane];
                    if (h >= 0) released = h + 1;
                }
                if (released > returned && (released - returned >= num_rdma_send || tmin >= end)) {
                    rdma.add(offset_in(rdma_base, rl.head.on(rdma_base, channel, node)), released - returned, lane);
                    returned = released;
                }
            }
            cursor = tmin;
            if (tmin >= end) break;
        }
        if (lane < N) rdma.quiet();
    }

    // kNVLAndRDMAForwarder (odd SM): warp n reduces origin node n's rows over my node's GPUs into node n's
    // RDMA ring.
    __device__ __forceinline__ void nvl_and_rdma_forwarder(int first_node) const {
        // (nodes w, w + 16, ... one after the other: every node's warp w takes them in the same order, so the
        // lower node never waits for a higher one and the chain cannot close into a cycle)
        bool ok = true;
        for (int n = first_node; ok && n < N; n += CombineShape<N, G>::kOddWarps) {
            const int* row = recv_rdma_channel_prefix_matrix + n * num_channels;
            const int total = row[channel] - (channel > 0 ? row[channel - 1] : 0);
            const int row_base = (n > 0 ? recv_rdma_rank_prefix_sum[n - 1] : 0) + (channel > 0 ? row[channel - 1] : 0);
            int4* ring = rdma_ring_for(rdma, rl.data, channel, node, n);
            // producer of node n's RDMA ring (its tail is published by rdma_publish_slots)
            const RingProducer<> out{nullptr, rl.head.on(rdma_base, channel, n), num_rdma_slots};
            long long* slot = sh.slot[warp];
            const int4* nvl0 = nl.x.on(my_nvl, channel, 0);  // GPU j's ring: + j * elems_per_rank
            int issued = 0, head = 0;
            while (ok && issued < total) {
                const int chunk = min(min(num_rdma_send, total - issued), num_rdma_slots - issued % num_rdma_slots);
                ok = out.wait_for_space<kByWarpAll, false>(
                    ctx, WaitSite{kKernelInternodeCombine, kNVLAndRDMAForwarder, channel, n}, issued, head, chunk,
                    [&](long long& h, long long& tl, long long& e) {
                        h = head;
                        tl = issued;
                        e = chunk;
                    });
                for (int i = issued; ok && i < issued + chunk; ++i) {
                    const int h = lane < G ? send_nvl_head[(long long)(row_base + i) * G + lane] : -1;
                    int seen = 0;  // lane j: consumer of sub-ring n of GPU j's ring
                    ok = RingConsumer{nl.tail.on(my_nvl, channel, lane) + n, nullptr}.wait_for_data<kByWarpAll>(
                        ctx, WaitSite{kKernelInternodeCombine, kNVLAndRDMAForwarder, channel, N + lane}, h + 1, seen,
                        [&](long long& hh, long long& tl, long long& e) {
                            hh = h;
                            tl = ld_volatile(nl.tail.on(my_nvl, channel, lane) + n);
                            e = h + 1;
                        },
                        h >= 0);
                    if (!ok) break;
                    if (lane < G)
                        slot[lane] =
                            h >= 0 ? lane * nl.x.elems_per_rank + (long long)(n * sub_slots + h % sub_slots) * fmt.int4s
                                   : -1;
                    __syncwarp();
                    int4* dst = ring + (long long)(i % num_rdma_slots) * fmt.int4s;
                    reduce_rows<G>(dst, nvl0, slot, nullptr, nullptr, hidden_int4);
                    for (int kk = lane; kk < num_topk; kk += kWarpSize)
                        reinterpret_cast<float*>(reinterpret_cast<char*>(dst) + fmt.weights_off)[kk] =
                            sum_token_weight<G>(nvl0, slot, fmt.weights_off, kk);
                    __syncwarp();
                    // One consumer per sub-ring, in order: the slot is free again.
                    if (lane < G && h >= 0) ring_release(nl.head.on(nvl_ptrs[lane], channel, nvl_rank) + n, h + 1);
                }
                if (!ok) break;
                // Every lane's slot stores (into node n's receive half on the direct path, my send half for a put)
                // -> its fence.acq_rel.sys -> __syncwarp -> lane 0's rdma.fence() (system scope) -> the tail add.
                __syncwarp();
                fence_acq_rel_sys();
                rdma_publish_slots(rdma, rl.data, rl.tail, channel, node, n, issued % num_rdma_slots, chunk, fmt.int4s,
                                   fmt.bytes);
                issued += chunk;
            }
        }
        __syncwarp();
        if (lane == 0) rdma.quiet();
    }
};

}  // namespace ep::internode
