// Device helper shared by the MoE kernels (moe.cu, moe_experts.cu; C++17): SiTU-GLU's FP32 math (moe.h).
#pragma once

#include "ops/moe.h"

namespace k3::ops::cuda::detail {

__device__ __forceinline__ float situ_dev(float a, float b, SituParams p) {
  const float sig = 1.f / (1.f + expf(-a));  // expf overflow gives 1 / inf = 0, as on the CPU
  const float gate = p.beta * tanhf(a / p.beta) * sig;
  const float lin = p.linear_beta * tanhf(b / p.linear_beta);
  return gate * lin;
}

}  // namespace k3::ops::cuda::detail
