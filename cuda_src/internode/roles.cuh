// internode/roles.cuh: the warp roles and the block shapes of the internode kernels.
#pragma once
#include "common/warp.cuh"

namespace ep::internode {

enum WarpRole : int {
    // dispatch
    kRDMASender = 10, kRDMASenderCoordinator = 11, kRDMAAndNVLForwarder = 12, kForwarderCoordinator = 13,
    kNVLReceivers = 14,
    // combine
    kNVLSender = 15, kNVLAndRDMAForwarder = 16, kRDMAReceiver = 17, kCoordinator = 18,
    // notify / barriers (diagnostics only)
    kRoleRdmaBarrier = 19, kRoleNvlBarrier = 20, kIdle = 21,
    // num_worst_tokens too small for what this rank receives (head = needed, tail = allocated rows,
    // expected = 0: recv rows, 1: rows received over RDMA); not a wait, but it stops the buffer the same way
    kRoleCapacity = 22,
};

// A warp's role in a dispatch or combine block (computed once per warp: dispatch_role_of / combine_role_of) and
// its target (the GPU or node index the role serves; 0 where it serves all).
struct RoleOf {
    int role;  // WarpRole
    int target;
};

constexpr int kDispatchSenderWarps = 6;
constexpr int kCombineRecvWarps = 6;
constexpr int kMaxCombineForwarderWarps = 16;  // warp w forwards to nodes w, w + 16 (in that order on every node)
constexpr int kNotifyThreads = 256;   // mirrors cuda_internode._NOTIFY_THREADS
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kSendWindow = 32;       // tokens a sender may run ahead of the in-order release, per node

template <int kNumNvlRanks>
struct DispatchShape {
    static constexpr int kWarps = kDispatchSenderWarps + 1 + kNumNvlRanks;  // odd SM; the even SM uses G + 1
    static constexpr int kThreads = kWarps * kWarpSize;
};

template <int kNumRdmaRanks, int kNumNvlRanks>
struct CombineShape {
    static constexpr int kEvenWarps = kNumNvlRanks + kCombineRecvWarps + 1;
    static constexpr int kOddWarps = kNumRdmaRanks < kMaxCombineForwarderWarps ? kNumRdmaRanks : kMaxCombineForwarderWarps;
    static constexpr int kWarps = kEvenWarps > kOddWarps ? kEvenWarps : kOddWarps;
    static constexpr int kThreads = kWarps * kWarpSize;
};

}  // namespace ep::internode
