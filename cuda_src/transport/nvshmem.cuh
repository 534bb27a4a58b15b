// transport/nvshmem.cuh: NVSHMEM's device API for kernels compiled by NVRTC (relocatable, linked with the pip wheel's
// libnvshmem_device.a by jit.py). Include it instead of <nvshmem.h>.
#pragma once

// NVSHMEM 3.4's collective headers name std:: traits that NVRTC only has as cuda::std:: (fixed upstream in
// 3.6); alias the few they use.
#include <cuda/std/type_traits>
namespace std {
using cuda::std::enable_if;
using cuda::std::false_type;
using cuda::std::is_empty;
using cuda::std::is_floating_point;
using cuda::std::is_integral;
using cuda::std::is_same;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
using cuda::std::true_type;
}  // namespace std

#include <nvshmem.h>
#include <nvshmemx.h>
