// low_latency/dispatch.cuh: the low-latency dispatch's send and receive phases.
#pragma once
#include "low_latency/common.cuh"

namespace ep::low_latency {

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
__device__ void build_histograms(const TopkT* topk_idx, int num_tokens, int num_topk, int num_experts, int first_token,
                                 int* hist, int* hist_all) {
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
__device__ void advance_histogram(const TopkT* topk_idx, int from_token, int to_token, int num_topk, int num_experts,
                                  int* hist) {
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
// kMaxTopk: the kernel's top-k bound (kLLTopkBounds), at least the call's K.
template <int kMaxTopk>
struct DispatchShared {
    int expert[kMaxTopk];        // token_slots: global expert of entry k
    int slot[kMaxTopk];          // token_slots: its slot, -1 = not kept
    int put_dest[kMaxTopk];      // destination ranks reached by NVSHMEM puts (no NVLink mapping), num_put of them
    char* target[kMaxTopk + 1];  // where the message bytes are stored: each mapped destination's recv slot
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
template <typename Shared>
__device__ __forceinline__ void token_targets(long long e, int num_experts, int num_local, long long recv_msg,
                                              char* send_msg, Shared& sh) {
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
template <typename Shared>
__device__ __forceinline__ void send_index_entries(int t, int num_topk, char* base, const LowLatencyLayout& L,
                                                   long long recv, int rank, const Shared& sh) {
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
__device__ __forceinline__ void check_buffer_alternates(int* workspace, int buffer_idx, const DeviceCtx* ctx,
                                                        int kernel) {
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
template <typename Shared>
__device__ __forceinline__ void send_counts(const int* hist_all, char* base, const LowLatencyLayout& L, int buffer_idx,
                                            int rank, const Shared& sh) {
    if (lane_id() != 0 || warp_id() == 0) return;  // (warp 0 goes on to the token's slots)
    const FastDiv by_local(L.num_local);
    for (int e = blockIdx.x + gridDim.x * (warp_id() - 1); e < L.num_experts; e += gridDim.x * (kLLWarps - 1)) {
        const int count = min(hist_all[e], L.num_max_tokens), pe = by_local.div(e);
        if (has_rank(sh.masked, pe)) continue;
        const long long offset = L.signal_offset(buffer_idx) + 8LL * L.dispatch_count(by_local.mod(e), rank);
        const long long value = ((long long)sh.epoch << 32) | (unsigned)count;
        char* direct = reinterpret_cast<char*>(sh.peer[pe]);
        if (direct != nullptr)
            st_relaxed_sys(reinterpret_cast<long long*>(direct + offset), value);
        else
            ll_put_longlong(reinterpret_cast<long long*>(base + offset), value, pe);
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
template <bool kUseFP8, typename Shared>
__device__ __forceinline__ void send_message(const int4* x, const TokenLoads& in, int t, bool round_scale, char* send,
                                             long long recv, const LowLatencyLayout& L, int rank, Shared& sh,
                                             long long* stamps) {
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
// once the puts are complete: each warp quiets its own). More destinations than warps (a top-k above kLLWarps
// over as many nodes): a warp puts the whole row to each of destinations warp, warp + kLLWarps, ... Kept out of
// line: only the put path calls it, and inlined its NVSHMEM code would take registers from the kernel's common path.
template <typename Shared>
__device__ __noinline__ void put_message(char* base, const char* send_msg, long long recv_msg, int msg_int4,
                                         const Shared& sh) {
    const int num_put = sh.num_put, warps_per_dest = max(1, kLLWarps / num_put), row_int4 = msg_int4 - 1;
    const int groups = kLLWarps / warps_per_dest, part = warp_id() % warps_per_dest;
    const int part_int4 = (row_int4 + warps_per_dest - 1) / warps_per_dest;
    const int begin = 1 + part * part_int4, n = min(part_int4, msg_int4 - begin);
    for (int d = warp_id() / warps_per_dest; d < num_put; d += groups)
        if (n > 0) ll_put_warp(base + recv_msg + begin * 16LL, send_msg + begin * 16LL, (size_t)n * 16, sh.put_dest[d]);
    if (warp_id() / warps_per_dest >= num_put) return;
    __syncwarp();
    if (lane_id() == 0) ll_quiet();
}

// Dispatch send, warp 0 first: peer_bases and the call's epoch into shared memory (token_targets reads them after
// a __syncwarp, everyone else after a block barrier): one global load each per block instead of one per use.
template <typename Shared>
__device__ __forceinline__ void stage_send_shared(const unsigned long long* peer_bases, int num_ranks,
                                                  const int* workspace, int buffer_idx, const int* shrink_mask,
                                                  Shared& sh) {
    if (warp_id() != 0) return;
    for (int r = lane_id(); r < num_ranks; r += kWarpSize) sh.peer[r] = peer_bases[r];
    if (lane_id() == 0) sh.epoch = dispatch_epoch(workspace, buffer_idx);
    stage_masked(shrink_mask, num_ranks, sh.masked);
}

// Dispatch send. The block's first token goes out before the histograms (its destinations do not depend on the
// slots); then per token its slots, one block barrier, and its index entries, each after a system-scope release.
template <bool kUseFP8, typename TopkT, typename Shared>
__device__ void dispatch_send(const int4* x, const TopkT* topk_idx, int* topk_slots, int num_tokens, int num_topk,
                              bool round_scale, char* base, const unsigned long long* peer_bases,
                              const LowLatencyLayout& L, int rank, int buffer_idx, int* workspace,
                              const int* shrink_mask, const DeviceCtx* ctx, int* hist, int* hist_all, TopkT* topk_stage,
                              Shared& sh, long long* stamps) {
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
        send_message<kUseFP8>(x, first, blockIdx.x, round_scale, base + L.send_offset(buffer_idx), recv, L, rank, sh,
                              stamps);
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
        const bool ok = wait_until<true>(
            ctx, WaitSite{kKernelLowLatencyDispatch, kRoleReceiver, i / L.num_ranks, i % L.num_ranks},
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
    const bool ok = wait_until<true>(
        ctx, WaitSite{kKernelLowLatencyDispatch, kRoleReceiver, e, s},
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
                                                   int* packed_recv_src_info, bool use_ue8m0, const LowLatencyLayout& L,
                                                   const int* shrink_mask, const DeviceCtx* ctx, long long* stamps) {
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
        __syncwarp();     // the message's bytes are read after lane 0's acquire of its entry
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
            reinterpret_cast<int*>(
                packed_recv_scales)[((long long)e * words + w) * rows_per_expert + (out_row - e * rows_per_expert)] =
                value;
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
                packed_recv_layout_range[(long long)e * R + s] =
                    ((long long)(from - begin) << 32) | (prefix[e * R + s + 1] - from);
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

}  // namespace ep::low_latency
