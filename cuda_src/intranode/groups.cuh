// intranode/groups.cuh: how the warps of a dispatch / combine block are grouped over the peer ranks.
#pragma once
#include "common/warp.cuh"  // and common/ids.cuh: kIntranodeWarps

namespace ep::intranode {

// The warp roles of the intranode ring kernels (dispatch_role_of, combine_role_of) and their target (the peer rank a
// ring role serves; an own-row block's index).
enum ChannelRole : int { kSender, kReceiver, kOwnRows, kIdle };
struct RoleOf {
    int role;  // ChannelRole
    int target;
};

// Warps of a dispatch/combine block, grouped per peer rank (kIntranodeWarps = 24, or the largest multiple of R below).
template <int kNumRanks>
struct Groups {
    static constexpr int kWarpsPerRank = kIntranodeWarps / kNumRanks;
    static constexpr int kWarps = kWarpsPerRank * kNumRanks;
    static constexpr int kThreads = kWarps * kWarpSize;
    static constexpr int kThreadsPerRank = kWarpsPerRank * kWarpSize;
};

// Warp groups over the R-1 remote peers. Only where that gives every peer more warps than Groups does
// (R <= 5) are the warps regrouped; otherwise group g serves peer g and the own group idles (same width,
// and the plain mapping keeps the kernels within their 80 registers).
template <int kNumRanks>
struct RemoteGroups {
    static constexpr int kRemoteRanks = kNumRanks > 1 ? kNumRanks - 1 : 1;  // R = 1: nothing remote
    static constexpr bool kRegroup = Groups<kNumRanks>::kWarps / kRemoteRanks > Groups<kNumRanks>::kWarpsPerRank;
    static constexpr int kWarpsPerPeer =
        kRegroup ? Groups<kNumRanks>::kWarps / kRemoteRanks : Groups<kNumRanks>::kWarpsPerRank;
    static constexpr int kThreadsPerPeer = kWarpsPerPeer * kWarpSize;
    // The dispatch sender claims ring slots for a batch of windows of 32 tokens at a time, enough for about
    // four rows per warp: one barrier per window would leave most warps waiting for the one with an extra row.
    static constexpr int kBatchWindows = (kWarpsPerPeer * 4 + kWarpSize - 1) / kWarpSize;
    static constexpr int kBatchTokens = kBatchWindows * kWarpSize;  // = validate.intranode_dispatch_batch

    // This warp's group: the peer it serves (-1: the warp idles) and its index in the group.
    __device__ static int peer_of_warp(int rank) {
        const int group = warp_id() / kWarpsPerPeer;
        if (kNumRanks <= 1) return -1;
        if (kRegroup) return group < kNumRanks - 1 ? (group >= rank ? group + 1 : group) : -1;
        return group != rank ? group : -1;
    }
    __device__ static int warp_in_group() { return warp_id() % kWarpsPerPeer; }
};

}  // namespace ep::intranode
