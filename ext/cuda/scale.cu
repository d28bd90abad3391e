// The dynamic loss-scale update on the device (one thread), and the ABI's small helpers.
// Same rule as ampfunc.ops._ref_update_scale: torch.amp's growth/backoff (products in double,
// stored in fp32; a growth that overflows fp32 is not applied) plus a min/max clamp and apex /
// DeepSpeed-style hysteresis.
#include <math.h>

#include "mta.cuh"

namespace ampfunc {
namespace cuda {
namespace {

struct ScaleConfig {
  double growth_factor, backoff_factor, min_scale, max_scale;
  int64_t growth_interval, hysteresis;
};

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                    const uint8_t* finite_flag, const ScaleConfig c) {
  const bool finite = *finite_flag != 0;
  const float s = *scale;
  const int32_t tracker = *growth_tracker;
  const int32_t hyst = *hysteresis_tracker;

  float grown = static_cast<float>(static_cast<double>(s) * c.growth_factor);
  grown = isfinite(grown) ? fminf(grown, static_cast<float>(c.max_scale)) : s;
  const float backed = fmaxf(static_cast<float>(static_cast<double>(s) * c.backoff_factor),
                             static_cast<float>(c.min_scale));
  const int64_t next_tracker = static_cast<int64_t>(tracker) + 1;
  const bool grow = finite && next_tracker >= c.growth_interval;
  const bool backoff = !finite && hyst <= 1;

  *scale = grow ? grown : (backoff ? backed : s);
  *growth_tracker = (finite && !grow) ? static_cast<int32_t>(next_tracker) : 0;
  *hysteresis_tracker = finite ? static_cast<int32_t>(c.hysteresis) : (hyst - 1 < 1 ? 1 : hyst - 1);
}

}  // namespace
}  // namespace cuda
}  // namespace ampfunc

using namespace ampfunc::cuda;

extern "C" int ampfunc_cuda_abi_version(void) { return AMPFUNC_CUDA_ABI_VERSION; }

extern "C" const char* ampfunc_cuda_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

extern "C" int ampfunc_cuda_update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                         const uint8_t* finite, double growth_factor, double backoff_factor,
                                         int64_t growth_interval, double min_scale, double max_scale,
                                         int64_t hysteresis, cudaStream_t stream) {
  if (scale == nullptr || growth_tracker == nullptr || hysteresis_tracker == nullptr || finite == nullptr)
    return cudaErrorInvalidValue;
  ScaleConfig c{growth_factor, backoff_factor, min_scale, max_scale, growth_interval, hysteresis};
  update_scale_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, hysteresis_tracker, finite, c);
  return cudaGetLastError();
}
