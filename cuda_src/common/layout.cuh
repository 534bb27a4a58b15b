// common/layout.cuh: the only place where communication buffers are carved.
//
// Every rank's NVLink buffer (one cudaMalloc, opened by its peers through CUDA IPC) is
//
//     [signals: kSignalBytes][notify area: NotifyArea][channel area: DispatchLayout or CombineLayout]
//
// The channel area is a sequence of arrays, each cut channel first, then by rank:
// [channel][rank][elements], every array rounded up to kAlign bytes. The offset of (channel c, rank r)
// inside an array is (c * num_ranks + r) * elements, i.e. a channel's slices sit together at
// c * bytes_per_rank * num_ranks. Offsets are relative to a rank's base pointer, so the same layout object
// addresses the local buffer and every peer's buffer.
//
// cupy_ep/config.py mirrors these sums (dispatch_channel_bytes, combine_channel_bytes, NOTIFY_BYTES); a
// GPU test compares both through carve_probe (intranode.cu).
#pragma once
#include "common/warp.cuh"

namespace ep {

constexpr int kMaxNvlRanks = 8;          // ranks of one NVLink domain (mirrors config.MAX_NVL_RANKS)
constexpr int kMaxLocalExperts = 1024;   // experts per rank (mirrors config.MAX_LOCAL_EXPERTS)
constexpr int kMaxTopk = 32;             // mirrors config.MAX_TOPK

constexpr long long kAlign = 128;
constexpr long long kSignalBytes = 128;  // int barrier_signal[kMaxNvlRanks], padded

__host__ __device__ __forceinline__ long long align_up(long long v, long long a) { return (v + a - 1) / a * a; }

// Walks an allocation front to back, handing out aligned arrays (as offsets from a base).
struct Carver {
    long long offset;
    __device__ explicit Carver(long long start) : offset(start) {}
    __device__ long long take(long long bytes) {
        const long long at = offset;
        offset += align_up(bytes, kAlign);
        return at;
    }
};

template <typename T>
__device__ __forceinline__ T* at_offset(void* base, long long offset) {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

__device__ __forceinline__ long long offset_in(const void* base, const void* p) {
    return static_cast<const char*>(p) - static_cast<const char*>(base);
}

// [elements]: a plain array, not split by channel.
template <typename T>
struct Buffer {
    long long offset = 0;
    __device__ Buffer() {}
    __device__ Buffer(Carver& c, long long num_elems) : offset(c.take(num_elems * (long long)sizeof(T))) {}
    __device__ T* on(void* base) const { return at_offset<T>(base, offset); }
};

// [channel][rank][elements]: one side's queues (e.g. a receiver's rings, indexed by source rank).
template <typename T>
struct AsymBuffer {
    long long offset = 0, elems_per_rank = 0;
    int num_ranks = 0;
    __device__ AsymBuffer() {}
    __device__ AsymBuffer(Carver& c, int num_channels, int ranks, long long elems)
        : offset(c.take((long long)num_channels * ranks * elems * (long long)sizeof(T))),
          elems_per_rank(elems), num_ranks(ranks) {}
    // The (channel, rank) slice inside the buffer whose base pointer is `base`.
    __device__ T* on(void* base, int channel, int rank) const {
        return at_offset<T>(base, offset) + ((long long)channel * num_ranks + rank) * elems_per_rank;
    }
};

// [send|recv][channel][rank][elements]: both halves at the same offsets on every rank, so a put into a
// peer's recv(channel, my_rank) needs no address exchange (internode RDMA domain).
template <typename T>
struct SymBuffer {
    long long offset = 0, elems_per_rank = 0, half_elems = 0;
    int num_ranks = 0;
    __device__ SymBuffer() {}
    __device__ SymBuffer(Carver& c, int num_channels, int ranks, long long elems)
        : offset(c.take(2LL * num_channels * ranks * elems * (long long)sizeof(T))),
          elems_per_rank(elems), half_elems((long long)num_channels * ranks * elems), num_ranks(ranks) {}
    __device__ T* send(void* base, int channel, int rank) const {
        return at_offset<T>(base, offset) + ((long long)channel * num_ranks + rank) * elems_per_rank;
    }
    __device__ T* recv(void* base, int channel, int rank) const {
        return send(base, channel, rank) + half_elems;
    }
};

// ---------------------------------------------------------------------------------------------------
// Intranode (NVLink domain) layouts
// ---------------------------------------------------------------------------------------------------

// Count exchange of notify_dispatch: row-major matrix [src][dst] of tokens, and per source rank the
// token counts of the receiving rank's local experts. call_words[src][kCallWords]: what each rank says
// this call is (op, channels, ring slots, row size...), compared by every rank before any ring is used.
// num_tokens[src]: the source's token count, published by cached_notify_combine (a combine's sender needs
// the token owner's count to find the owner's channel ranges).
// The entry handshake of the zero-copy kernels (intranode.cu, open_direct_call / wait_direct_call):
//   entry[src]                     the epoch of src's latest zero-copy call on this buffer (written by src)
//   entry_words[parity][src][kCallWords]  what src says that call is (parity = epoch & 1: a peer can be one
//                                  call ahead, and its next words must not overwrite the ones being compared)
//   entry_epoch, entry_arrivals    local: the zero-copy calls begun on this buffer, and the blocks of the current
//                                  call that have read that count (the last one advances it)
constexpr int kCallWords = 8;
struct NotifyArea {
    Buffer<int> rank_matrix;     // [kMaxNvlRanks * kMaxNvlRanks]
    Buffer<int> expert_counts;   // [kMaxNvlRanks][kMaxLocalExperts]
    Buffer<int> call_words;      // [kMaxNvlRanks][kCallWords]
    Buffer<int> num_tokens;      // [kMaxNvlRanks]
    Buffer<int> entry;           // [kMaxNvlRanks]
    Buffer<int> entry_words;     // [2][kMaxNvlRanks][kCallWords]
    Buffer<int> entry_epoch;     // [1]
    Buffer<int> entry_arrivals;  // [1]
    long long end;
    __device__ NotifyArea() {
        Carver c(kSignalBytes);
        rank_matrix = Buffer<int>(c, kMaxNvlRanks * kMaxNvlRanks);
        expert_counts = Buffer<int>(c, (long long)kMaxNvlRanks * kMaxLocalExperts);
        call_words = Buffer<int>(c, kMaxNvlRanks * kCallWords);
        num_tokens = Buffer<int>(c, kMaxNvlRanks);
        entry = Buffer<int>(c, kMaxNvlRanks);
        entry_words = Buffer<int>(c, 2 * kMaxNvlRanks * kCallWords);
        entry_epoch = Buffer<int>(c, 1);
        entry_arrivals = Buffer<int>(c, 1);
        end = c.offset;
    }
};

__device__ __forceinline__ int* barrier_signals(void* base) { return static_cast<int*>(base); }

// Dispatch rings, in the *receiver's* buffer, indexed [channel][source rank].
struct DispatchLayout {
    AsymBuffer<int> start, end, head, tail;   // -v-1 encoded token offsets; ring counters
    AsymBuffer<int4> x;                       // [slots][hidden_int4]
    AsymBuffer<int> src_idx;                  // [slots]
    AsymBuffer<int> topk_idx;                 // [slots][topk]  local expert id or -1 (int32 on the wire)
    AsymBuffer<float> topk_weights;           // [slots][topk]
    AsymBuffer<float> scales;                 // [slots][num_scales]
    long long begin, meta_end, total_end;     // meta = start/end/head/tail (zeroed by notify)
    __device__ DispatchLayout(int num_channels, int num_ranks, int num_slots, int hidden_int4, int num_topk,
                              int num_scales) {
        Carver c(NotifyArea().end);
        begin = c.offset;
        start = AsymBuffer<int>(c, num_channels, num_ranks, 1);
        end = AsymBuffer<int>(c, num_channels, num_ranks, 1);
        head = AsymBuffer<int>(c, num_channels, num_ranks, 1);
        tail = AsymBuffer<int>(c, num_channels, num_ranks, 1);
        meta_end = c.offset;
        x = AsymBuffer<int4>(c, num_channels, num_ranks, (long long)num_slots * hidden_int4);
        src_idx = AsymBuffer<int>(c, num_channels, num_ranks, num_slots);
        topk_idx = AsymBuffer<int>(c, num_channels, num_ranks, (long long)num_slots * num_topk);
        topk_weights = AsymBuffer<float>(c, num_channels, num_ranks, (long long)num_slots * num_topk);
        scales = AsymBuffer<float>(c, num_channels, num_ranks, (long long)num_slots * num_scales);
        total_end = c.offset;
    }
};

// Combine rings, in the *token owner's* buffer, indexed [channel][expert rank].
struct CombineLayout {
    AsymBuffer<int> head, tail;
    AsymBuffer<int4> x;               // [slots][hidden_int4] bf16
    AsymBuffer<float> topk_weights;   // [slots][topk]
    long long begin, meta_end, total_end;
    __device__ CombineLayout(int num_channels, int num_ranks, int num_slots, int hidden_int4, int num_topk) {
        Carver c(NotifyArea().end);
        begin = c.offset;
        head = AsymBuffer<int>(c, num_channels, num_ranks, 1);
        tail = AsymBuffer<int>(c, num_channels, num_ranks, 1);
        meta_end = c.offset;
        x = AsymBuffer<int4>(c, num_channels, num_ranks, (long long)num_slots * hidden_int4);
        topk_weights = AsymBuffer<float>(c, num_channels, num_ranks, (long long)num_slots * num_topk);
        total_end = c.offset;
    }
};


// Zero-copy dispatch (dispatch(..., zero_copy=True)), in the *receiver's* buffer: the senders store every row
// straight into its final row here, so there is no ring and no receiver copy; the caller gets `x` as recv_x
// (a view, valid until the next call on the buffer). Rows are in recv_x's order (source rank, then source
// token); the small per-row outputs sit beside them and are copied into fresh arrays once all rows are in.
//   done            rows whose stores were released to this rank, plus one per source rank (that source's
//                   block 0 also releases its channel starts); zeroed by notify_dispatch, or in a cached call by
//                   dispatch_direct's own block 0 before it lets the ranks in (open_direct_call)
//   channel_starts  [kMaxNvlRanks][channels] source s's first row of channel c (recv_channel_prefix_matrix)
// capacity: rows that fit (config.direct_dispatch_capacity); the ranks agree on it in notify_dispatch or in the
// entry handshake.
struct DirectDispatchLayout {
    Buffer<int> done;            // [1]
    Buffer<int> channel_starts;  // [kMaxNvlRanks][num_channels]
    Buffer<int4> x;              // [capacity][hidden_int4]
    Buffer<int> src_idx;         // [capacity]
    Buffer<int> topk_idx;        // [capacity][topk]  local expert id or -1
    Buffer<float> topk_weights;  // [capacity][topk]
    Buffer<float> scales;        // [capacity][num_scales]
    long long begin, meta_end, total_end;
    __device__ DirectDispatchLayout(int num_channels, long long capacity, int hidden_int4, int num_topk,
                                    int num_scales) {
        Carver c(NotifyArea().end);
        begin = c.offset;
        done = Buffer<int>(c, 1);
        channel_starts = Buffer<int>(c, (long long)kMaxNvlRanks * num_channels);
        meta_end = c.offset;
        x = Buffer<int4>(c, capacity * hidden_int4);
        src_idx = Buffer<int>(c, capacity);
        topk_idx = Buffer<int>(c, capacity * num_topk);
        topk_weights = Buffer<float>(c, capacity * num_topk);
        scales = Buffer<float>(c, capacity * num_scales);
        total_end = c.offset;
    }
};

// Zero-copy combine (combine(..., zero_copy=True)), in the *token owner's* buffer: expert rank r stores the rows
// it sends back to this rank at [r][j], j = the row's index in r's block of rows from this rank (= the
// owner's send_head[t][r]), and releases every `rows_per_flag` rows (config.DIRECT_COMBINE_ROWS_PER_FLAG) with
// one flag. The owner reduces a token once the flags of its rows are set: no ring, no flow control.
//   flags  [capacity][num_ranks]  flag [k][r]: rows [k * rows_per_flag, (k + 1) * rows_per_flag) from rank r are
//          in; combine_direct's block 0 zeroes the ones a call can use (a prefix: k < the owner's token count)
//          before it lets the ranks in (open_direct_call)
// capacity: rows per source rank (config.direct_combine_capacity); the ranks agree on it in the entry handshake.
struct DirectCombineLayout {
    Buffer<int> flags;          // [capacity][num_ranks] (room for one flag per row)
    Buffer<int4> x;             // [num_ranks][capacity][hidden_int4]
    Buffer<float> topk_weights; // [num_ranks][capacity][topk]
    long long begin, meta_end, total_end, capacity;
    __device__ DirectCombineLayout(int num_ranks, long long capacity_, int hidden_int4, int num_topk)
        : capacity(capacity_) {
        Carver c(NotifyArea().end);
        begin = c.offset;
        flags = Buffer<int>(c, num_ranks * capacity);
        meta_end = c.offset;
        x = Buffer<int4>(c, num_ranks * capacity * hidden_int4);
        topk_weights = Buffer<float>(c, num_ranks * capacity * num_topk);
        total_end = c.offset;
    }
};

// ---------------------------------------------------------------------------------------------------
// Low-latency (NVSHMEM symmetric heap) layout: two buffers used alternately, signals first:
// [sig0][sig1][send0][send1][recv0][recv1].
//   signals  int[2E + R*M + R]: dispatch: int64 [L][R] the count from (local expert e, src rank s) at e*R + s
//                    as epoch << 32 | count (never consumed: the epoch tells this call's from older ones);
//                    then the combine's (from int 2E): flag 1 from expert rank r for token t at r*M + t (its
//                    partial row is written), and from owner s at R*M + s its meta's (K << 24 | T + 1), each
//                    zeroed by its reader.
//   send     dispatch: the cast message of token t at t * msg (the source of NVSHMEM puts);
//            combine:  bf16 rows [L][R*M][H] (the zero-copy buffer).
//   recv     dispatch: messages [R][M] (src rank, src token: each token arrives once per destination rank),
//                      then the index table int64 [L][R][M] (local expert, src rank, slot) -> epoch << 32 | src
//                      token;
//            combine (after the dispatch's area, at combine_offset):
//                      partial_in [R][M] rows of 3H bytes (expert rank r's weighted fp32 sum of its rows of
//                      token t, rounded to 24 bits: the bf16 high halves [H], then the next byte of each [H];
//                      reference.low_latency_partial_wire),
//                      partial_out [R][M] the same (the rows this rank computed for owner s: source of puts),
//                      meta_in [R] (owner s's top-k: int32 experts [M][kLLMaxTopk], then float weights),
//                      meta_out [R] (this rank's meta for rank r: source of puts).
// A dispatch message is a 16-byte header (int flag: the epoch of the dispatch that wrote it, written after the
// row; 3 reserved ints), then the row
// (bf16, or e4m3 followed by H/128 float scales). Its size is fixed at 16 + 2H (>= 16 + H + H/32), so
// the layout does not depend on use_fp8. cupy_ep/config.py mirrors this (low_latency_layout).
// ---------------------------------------------------------------------------------------------------
constexpr int kLLMaxTopk = 11;  // mirrors reference.LOW_LATENCY_MAX_TOPK

struct LowLatencyLayout {
    long long msg_bytes, row_bytes, part_bytes, meta_bytes, signal_ints, signal_bytes, send_bytes, recv_bytes,
        total_bytes, index_offset, combine_offset, meta_offset;
    int num_max_tokens, hidden, num_ranks, num_experts, num_local;
    __host__ __device__ LowLatencyLayout(int max_tokens, int hidden_, int ranks, int experts)
        : num_max_tokens(max_tokens), hidden(hidden_), num_ranks(ranks), num_experts(experts),
          num_local(experts / ranks) {
        msg_bytes = 16 + 2LL * hidden;
        row_bytes = 2LL * hidden;
        part_bytes = 3LL * hidden;  // a 24-bit partial per element: bf16 plane + byte plane
        const long long m = max_tokens, e = experts, r = ranks;
        meta_bytes = align_up(m * kLLMaxTopk * 8, 16LL);
        signal_ints = 2 * e + r * m + r;  // dispatch counts int64 [L][R], then the combine's flags
        signal_bytes = align_up(signal_ints * 4, kAlign);
        send_bytes = align_up(m * msg_bytes > e * m * row_bytes ? m * msg_bytes : e * m * row_bytes, kAlign);
        index_offset = r * m * msg_bytes;  // a multiple of 16
        // the combine's area follows the dispatch's (no overlap: the dispatch's flags and index entries carry the
        // call's epoch, and a stale value must come from an older dispatch, never from the combine's data)
        combine_offset = align_up(index_offset + e * m * 8, 16LL);
        meta_offset = combine_offset + 2 * r * m * part_bytes;
        recv_bytes = align_up(meta_offset + 2 * r * meta_bytes, kAlign);
        total_bytes = 2 * (signal_bytes + send_bytes + recv_bytes);
    }
    // Region offsets from the symmetric base (the same on every PE, so they address peers too).
    __host__ __device__ long long signal_offset(int i) const { return i * signal_bytes; }
    __host__ __device__ long long send_offset(int i) const { return 2 * signal_bytes + i * send_bytes; }
    __host__ __device__ long long recv_offset(int i) const { return 2 * (signal_bytes + send_bytes) + i * recv_bytes; }
    // Offsets inside a region (bytes)
    __device__ long long dispatch_recv_msg(int src_rank, int token) const {
        return ((long long)src_rank * num_max_tokens + token) * msg_bytes;
    }
    __device__ long long dispatch_recv_index(int local_expert, int src_rank, int slot) const {
        return index_offset + (((long long)local_expert * num_ranks + src_rank) * num_max_tokens + slot) * 8;
    }
    __device__ long long combine_send_row(int local_expert, int row) const {
        return ((long long)local_expert * num_ranks * num_max_tokens + row) * row_bytes;
    }
    __device__ long long combine_partial_in(int expert_rank, int token) const {
        return combine_offset + ((long long)expert_rank * num_max_tokens + token) * part_bytes;
    }
    __device__ long long combine_partial_out(int owner, int token) const {
        return (long long)num_ranks * num_max_tokens * part_bytes + combine_partial_in(owner, token);
    }
    __device__ long long combine_meta_in(int owner) const { return meta_offset + owner * meta_bytes; }
    __device__ long long combine_meta_out(int dst_rank) const {
        return meta_offset + (num_ranks + dst_rank) * meta_bytes;
    }
    // inside a meta block: int32 experts [M][kLLMaxTopk] at 0, float weights at meta_weights()
    __device__ long long meta_weights() const { return (long long)num_max_tokens * kLLMaxTopk * 4; }
    // inside a signal region: the dispatch's counts (int64 index), then the combine's flags (int index)
    __device__ int dispatch_count(int local_expert, int src_rank) const { return local_expert * num_ranks + src_rank; }
    __device__ int combine_token_flag(int expert_rank, int token) const {
        return 2 * num_experts + expert_rank * num_max_tokens + token;
    }
    __device__ int combine_meta_flag(int owner) const { return 2 * num_experts + num_ranks * num_max_tokens + owner; }
};

// ---------------------------------------------------------------------------------------------------
// Internode layouts (cuda_src/internode.cu). Two buffers per rank:
//   RDMA buffer (NVSHMEM symmetric heap, or an IPC allocation for the test transport), shared by the N ranks
//     with the same GPU index ("the RDMA domain", indexed by node):
//       [barrier: int[kMaxRdmaRanks]][notify: SymBuffer<int>(1 channel, N, RdmaNotify ints)][channel area]
//   NVLink buffer (CUDA IPC), shared by the G ranks of one node:
//       [signals: kSignalBytes][notify: AsymBuffer<int>(1 channel, G, NvlNotify ints)][channel area]
// The channel area is InternodeDispatchRdma / InternodeCombineRdma (resp. ...Nvl): dispatch and combine
// carve the same bytes differently (they never run at once; the notify kernels zero the meta between
// barriers). Meta (counters) comes first in every carve so that one contiguous memset clears it.
// cupy_ep/config.py (internode_layout) mirrors every sum; internode_carve_probe lets a GPU test compare.
// ---------------------------------------------------------------------------------------------------
constexpr int kMaxRdmaRanks = 32;   // nodes (one warp lane each); mirrors config.MAX_RDMA_RANKS

// One token on the internode wire, in bytes from the token's start, rounded up to 16 bytes:
//   dispatch: [x: hidden_int4 * 16][scales: S float][pad to 8][SourceMeta: 2 int][topk_idx: K int32 (global)]
//             [weights: K float]
//   combine:  [x: hidden_int4 * 16 (bf16)][weights: K float]
struct TokenFormat {
    long long scales_off, meta_off, idx_off, weights_off, bytes;
    int int4s;
    __host__ __device__ TokenFormat(int hidden_int4, int num_scales, int num_topk, bool dispatch) {
        scales_off = (long long)hidden_int4 * 16;
        meta_off = align_up(scales_off + (dispatch ? 4LL * num_scales : 0), 8);  // SourceMeta is stored as an int2
        idx_off = meta_off + (dispatch ? 8 : 0);
        weights_off = idx_off + (dispatch ? 4LL * num_topk : 0);
        bytes = align_up(weights_off + 4LL * num_topk, 16);
        int4s = (int)(bytes / 16);
    }
};

// RDMA notify vector from one node to another: [call words][tokens per GPU of the destination node: G]
// [tokens needing the destination node: 1][tokens per expert of the destination node: G * kMaxLocalExperts].
// Padded to 4 ints so that a put of it is a whole number of int4.
__host__ __device__ __forceinline__ int rdma_notify_ints(int num_nvl_ranks) {
    return (int)align_up(kCallWords + num_nvl_ranks + 1 + (long long)num_nvl_ranks * kMaxLocalExperts, 4);
}
// NVL notify vector from GPU g to GPU j of the same node: [call words][tokens from (node n, GPU g) to j:
// kMaxRdmaRanks][per local expert of j, tokens from every source with GPU index g: kMaxLocalExperts].
constexpr int kNvlNotifyInts = kCallWords + kMaxRdmaRanks + kMaxLocalExperts;

struct InternodeRdmaNotify {
    Buffer<int> barrier;    // [kMaxRdmaRanks] arrivals (added to by each peer only), [kMaxRdmaRanks] my epoch
    SymBuffer<int> counts;  // [send|recv][1][N][rdma_notify_ints(G)]
    long long end;
    __device__ InternodeRdmaNotify(int num_rdma_ranks, int num_nvl_ranks) {
        Carver c(0);
        barrier = Buffer<int>(c, 2 * kMaxRdmaRanks);
        counts = SymBuffer<int>(c, 1, num_rdma_ranks, rdma_notify_ints(num_nvl_ranks));
        end = c.offset;
    }
};

struct InternodeNvlNotify {
    AsymBuffer<int> counts;  // [1][G (source GPU)][kNvlNotifyInts], in the receiving GPU's buffer
    long long end;
    __device__ explicit InternodeNvlNotify(int num_nvl_ranks) {
        Carver c(kSignalBytes);
        counts = AsymBuffer<int>(c, 1, num_nvl_ranks, kNvlNotifyInts);
        end = c.offset;
    }
};

// Dispatch meta per (channel, source node): ints [0, G) -v-1 encoded start of the source's tokens for each
// GPU of this node, [G, 2G) their end, 2G / 2G+1 the start / end of its tokens for this node; padded to 4.
__host__ __device__ __forceinline__ int rdma_meta_ints(int num_nvl_ranks) {
    return (int)align_up(2LL * num_nvl_ranks + 2, 4);
}

// RDMA domain, dispatch: indexed [channel][node].
//   meta / data: SymBuffer (send half = staging for puts to that node, recv half = landing from that node)
//   head: in the *sender's* buffer [channel][destination node] (added to by the destination's
//         kForwarderCoordinator, lazily); tail: in the *receiver's* buffer [channel][source node] (added to by
//         the source's kRDMASenderCoordinator after each chunk put).
struct InternodeDispatchRdma {
    SymBuffer<int> meta;
    AsymBuffer<int> head, tail;
    SymBuffer<int4> data;       // [slots][token int4s]
    long long begin, meta_end, total_end;
    __device__ InternodeDispatchRdma(int num_rdma_ranks, int num_nvl_ranks, int num_channels, int num_slots,
                                     int token_int4s) {
        Carver c(InternodeRdmaNotify(num_rdma_ranks, num_nvl_ranks).end);
        begin = c.offset;
        meta = SymBuffer<int>(c, num_channels, num_rdma_ranks, rdma_meta_ints(num_nvl_ranks));
        head = AsymBuffer<int>(c, num_channels, num_rdma_ranks, 1);
        tail = AsymBuffer<int>(c, num_channels, num_rdma_ranks, 1);
        meta_end = c.offset;
        data = SymBuffer<int4>(c, num_channels, num_rdma_ranks, (long long)num_slots * token_int4s);
        total_end = c.offset;
    }
};

// NVLink domain, dispatch: rings from a forwarder GPU to a receiving GPU of the same node, indexed
// [channel][other GPU]. prefix_start/prefix_end (-v-1 encoded, per source node), tail and x live in the
// receiver's buffer; head lives in the forwarder's buffer (each side polls its own memory).
struct InternodeDispatchNvl {
    AsymBuffer<int> prefix_start, prefix_end;   // [N] per (channel, forwarder)
    AsymBuffer<int> head, tail;
    AsymBuffer<int4> x;                         // [slots][token int4s]
    long long begin, meta_end, total_end;
    __device__ InternodeDispatchNvl(int num_rdma_ranks, int num_nvl_ranks, int num_channels, int num_slots,
                                    int token_int4s) {
        Carver c(InternodeNvlNotify(num_nvl_ranks).end);
        begin = c.offset;
        prefix_start = AsymBuffer<int>(c, num_channels, num_nvl_ranks, num_rdma_ranks);
        prefix_end = AsymBuffer<int>(c, num_channels, num_nvl_ranks, num_rdma_ranks);
        head = AsymBuffer<int>(c, num_channels, num_nvl_ranks, 1);
        tail = AsymBuffer<int>(c, num_channels, num_nvl_ranks, 1);
        meta_end = c.offset;
        x = AsymBuffer<int4>(c, num_channels, num_nvl_ranks, (long long)num_slots * token_int4s);
        total_end = c.offset;
    }
};

// RDMA domain, combine: the forwarder (reduced over its node) sends to the token's origin node.
// head in the forwarder's buffer [channel][origin node]; tail and data (recv half) in the origin's buffer.
struct InternodeCombineRdma {
    AsymBuffer<int> head, tail;
    SymBuffer<int4> data;
    long long begin, meta_end, total_end;
    __device__ InternodeCombineRdma(int num_rdma_ranks, int num_nvl_ranks, int num_channels, int num_slots,
                                    int token_int4s) {
        Carver c(InternodeRdmaNotify(num_rdma_ranks, num_nvl_ranks).end);
        begin = c.offset;
        head = AsymBuffer<int>(c, num_channels, num_rdma_ranks, 1);
        tail = AsymBuffer<int>(c, num_channels, num_rdma_ranks, 1);
        meta_end = c.offset;
        data = SymBuffer<int4>(c, num_channels, num_rdma_ranks, (long long)num_slots * token_int4s);
        total_end = c.offset;
    }
};

// NVLink domain, combine: expert rows go back to the GPU that forwarded them. Each (channel, source GPU)
// ring is split into N sub-rings of slots / N, one per origin node (a slow origin node cannot block the
// others). x and tail [N] live in the forwarder's buffer; head [N] in the sending GPU's buffer.
struct InternodeCombineNvl {
    AsymBuffer<int> head, tail;   // [N] per (channel, other GPU)
    AsymBuffer<int4> x;
    long long begin, meta_end, total_end;
    __device__ InternodeCombineNvl(int num_rdma_ranks, int num_nvl_ranks, int num_channels, int num_slots,
                                   int token_int4s) {
        Carver c(InternodeNvlNotify(num_nvl_ranks).end);
        begin = c.offset;
        head = AsymBuffer<int>(c, num_channels, num_nvl_ranks, num_rdma_ranks);
        tail = AsymBuffer<int>(c, num_channels, num_nvl_ranks, num_rdma_ranks);
        meta_end = c.offset;
        x = AsymBuffer<int4>(c, num_channels, num_nvl_ranks, (long long)num_slots * token_int4s);
        total_end = c.offset;
    }
};

// Contiguous token range of a channel: blocks of ceil(T / C) (mirrors reference.channel_ranges).
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int channel, int& begin, int& end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    begin = min(per * channel, num_tokens);
    end = min(begin + per, num_tokens);
}
// The same range as {begin, end}.
__device__ __forceinline__ int2 channel_bounds(int num_tokens, int num_channels, int channel) {
    int2 r;
    channel_range(num_tokens, num_channels, channel, r.x, r.y);
    return r;
}

}  // namespace ep
