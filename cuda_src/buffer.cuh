// buffer.cuh: the only place where communication buffers are carved.
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
#include "common.cuh"

namespace ep {

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
constexpr int kCallWords = 8;
struct NotifyArea {
    Buffer<int> rank_matrix;     // [kMaxNvlRanks * kMaxNvlRanks]
    Buffer<int> expert_counts;   // [kMaxNvlRanks][kMaxLocalExperts]
    Buffer<int> call_words;      // [kMaxNvlRanks][kCallWords]
    long long end;
    __device__ NotifyArea() {
        Carver c(kSignalBytes);
        rank_matrix = Buffer<int>(c, kMaxNvlRanks * kMaxNvlRanks);
        expert_counts = Buffer<int>(c, (long long)kMaxNvlRanks * kMaxLocalExperts);
        call_words = Buffer<int>(c, kMaxNvlRanks * kCallWords);
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


// ---------------------------------------------------------------------------------------------------
// Low-latency (NVSHMEM symmetric heap) layout: two buffers used alternately, signals first so that
// their offsets depend only on the expert count (as DeepEP): [sig0][sig1][send0][send1][recv0][recv1].
//   signals  int[E]: dispatch: count from (local expert e, src rank s) at e*R + s, encoded -count-1
//                    (0 = not arrived); combine: flag 1 from the owner of global expert e at e.
//   send     dispatch: the cast message of token t at t * msg (the source of NVSHMEM puts);
//            combine:  bf16 rows [L][R*M][H] (the zero-copy buffer, and the source of puts).
//   recv     dispatch: messages [L][R][M] (local expert, src rank, slot);
//            combine:  bf16 rows [E][M] (global expert, slot at the token owner).
// A dispatch message is a 16-byte header (int source token index, 3 reserved ints), then the row
// (bf16, or e4m3 followed by H/128 float scales). Its size is fixed at 16 + 2H (>= 16 + H + H/32), so
// the layout does not depend on use_fp8. cupy_ep/config.py mirrors this (low_latency_layout_bytes).
// ---------------------------------------------------------------------------------------------------
struct LowLatencyLayout {
    long long msg_bytes, row_bytes, signal_bytes, send_bytes, recv_bytes, total_bytes;
    int num_max_tokens, hidden, num_ranks, num_experts, num_local;
    __host__ __device__ LowLatencyLayout(int max_tokens, int hidden_, int ranks, int experts)
        : num_max_tokens(max_tokens), hidden(hidden_), num_ranks(ranks), num_experts(experts),
          num_local(experts / ranks) {
        msg_bytes = 16 + 2LL * hidden;
        row_bytes = 2LL * hidden;
        const long long m = max_tokens, e = experts;
        signal_bytes = align_up(e * 4, kAlign);
        send_bytes = align_up(m * msg_bytes > e * m * row_bytes ? m * msg_bytes : e * m * row_bytes, kAlign);
        const long long recv_dispatch = e * m * msg_bytes, recv_combine = e * m * row_bytes;
        recv_bytes = align_up(recv_dispatch > recv_combine ? recv_dispatch : recv_combine, kAlign);
        total_bytes = 2 * (signal_bytes + send_bytes + recv_bytes);
    }
    // Region offsets from the symmetric base (the same on every PE, so they address peers too).
    __host__ __device__ long long signal_offset(int i) const { return i * signal_bytes; }
    __host__ __device__ long long send_offset(int i) const { return 2 * signal_bytes + i * send_bytes; }
    __host__ __device__ long long recv_offset(int i) const { return 2 * (signal_bytes + send_bytes) + i * recv_bytes; }
    // Offsets inside a region (bytes)
    __device__ long long dispatch_recv_msg(int local_expert, int src_rank, int slot) const {
        return (((long long)local_expert * num_ranks + src_rank) * num_max_tokens + slot) * msg_bytes;
    }
    __device__ long long combine_send_row(int local_expert, int row) const {
        return ((long long)local_expert * num_ranks * num_max_tokens + row) * row_bytes;
    }
    __device__ long long combine_recv_row(int global_expert, int slot) const {
        return ((long long)global_expert * num_max_tokens + slot) * row_bytes;
    }
};

}  // namespace ep
