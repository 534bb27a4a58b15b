// probes/timing.cu: the benchmark's timing helper (the library does not use it).
#include "common/ptx.cuh"

namespace ep {

// One thread holds the stream for `ns` nanoseconds of %globaltimer. GpuTimer.aligned queues it after the ranks'
// device-side barrier and before the start event of a timed CUDA-graph replay: while it spins, every rank's host
// queues its replay behind it, so the timed span starts on the device with the replay already queued and the ranks
// together, without the hosts' launch skew or submission latency in it.
__global__ void spin_ns(long long ns) {
    const unsigned long long start = globaltimer_ns();
    while ((long long)(globaltimer_ns() - start) < ns) {
    }
}

}  // namespace ep
