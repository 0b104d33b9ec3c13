"""Proof of concept (not part of parity): the blockwise 1x128 quantizer, both usages, e4m3,
power-of-two scales, eps 0, as one compiled C++ pass per usage; bytes against parity's torch path,
time per call, compile time."""
import time, torch
torch.set_num_threads(1)
from torch.utils.cpp_extension import load_inline

SRC = r'''
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <cstring>

static inline float scale_of(float amax, float vinf) {
  // TE: amax in {0, inf, NaN} -> 1; s = RN32(448 / amax); inf -> vinf; clear the mantissa bits
  if (amax == 0.0f || std::isinf(amax) || std::isnan(amax)) return 1.0f;
  volatile float s = 448.0f / amax;
  float t = s;
  if (std::isinf(t)) t = vinf;
  uint32_t b; std::memcpy(&b, &t, 4); b &= 0xFF800000u; std::memcpy(&t, &b, 4);
  return t;
}

static inline uint8_t q8(float x, float s) {
  float y = x * s;
  if (y > 448.0f) y = 448.0f; else if (y < -448.0f) y = -448.0f;  // NaN passes through
  return c10::Float8_e4m3fn(y).x;
}

std::vector<torch::Tensor> quant_1x128_both(torch::Tensor x) {  // bf16 [M, K], K, M multiples of 128
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), Kb = K / 128, Mb = M / 128;
  const float vinf = 3.3895313892515355e38f;  // bf16 max
  auto rd = torch::empty({M, K}, torch::kUInt8), cd = torch::empty({K, M}, torch::kUInt8);
  auto rs = torch::empty({M, Kb}, torch::kFloat32), cs = torch::empty({Mb, K}, torch::kFloat32);
  const float* p = xf.data_ptr<float>();
  uint8_t* r = rd.data_ptr<uint8_t>(); uint8_t* c = cd.data_ptr<uint8_t>();
  float* rsp = rs.data_ptr<float>(); float* csp = cs.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < Kb; ++kb) {
      const float* row = p + m * K + kb * 128;
      float a = 0.0f;
      for (int i = 0; i < 128; ++i) { float v = std::fabs(row[i]); if (v > a) a = v; }  // NaN ignored
      float s = scale_of(a, vinf);
      rsp[m * Kb + kb] = 1.0f / s;
      for (int i = 0; i < 128; ++i) r[m * K + kb * 128 + i] = q8(row[i], s);
    }
  std::vector<float> am(K), sc(K);
  for (int64_t mb = 0; mb < Mb; ++mb) {
    std::fill(am.begin(), am.end(), 0.0f);
    for (int64_t i = 0; i < 128; ++i) {
      const float* row = p + (mb * 128 + i) * K;
      for (int64_t k = 0; k < K; ++k) { float v = std::fabs(row[k]); if (v > am[k]) am[k] = v; }
    }
    for (int64_t k = 0; k < K; ++k) { sc[k] = scale_of(am[k], vinf); csp[mb * K + k] = 1.0f / sc[k]; }
    for (int64_t i = 0; i < 128; ++i) {
      const float* row = p + (mb * 128 + i) * K;
      for (int64_t k = 0; k < K; ++k) c[k * M + mb * 128 + i] = q8(row[k], sc[k]);
    }
  }
  return {rd, rs, cd, cs};
}
'''
t0 = time.perf_counter()
ext = load_inline("poc_quant", cpp_sources=SRC, functions=["quant_1x128_both"],
                  extra_cflags=["-O2", "-ffp-contract=off", "-mavx2"], verbose=False)
print(f"compile + load: {time.perf_counter() - t0:.1f} s")

from parity.fp8.quantize import quantize
g = torch.Generator().manual_seed(1)
def case(M, K, kind):
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-30, 10, (M, K), generator=g).float())
    if kind == "edge":
        x[0, :128] = 0; x[1, 5] = float("nan"); x[2, 7] = float("inf"); x[3, :] = -0.0; x[4, 9] = 1e-38
    return x.bfloat16()
same = True
for M, K in ((128, 128), (128, 256), (256, 128), (384, 128)):
    for kind in ("rand", "edge"):
        x = case(M, K, kind)
        q = quantize(x, "blockwise", block="1x128")
        rd, rs, cd, cs = ext.quant_1x128_both(x)
        ok = (torch.equal(q.rowwise_data.view(torch.uint8).reshape(M, K), rd)
              and torch.equal(q.rowwise_scale_inv[:, :M].t().contiguous().view(torch.int32), rs.view(torch.int32))
              and torch.equal(q.columnwise_data.view(torch.uint8).reshape(K, M), cd)
              and torch.equal(q.columnwise_scale_inv[:, :K].contiguous().view(torch.int32), cs.view(torch.int32)))
        same &= ok
        print(M, K, kind, "bytes and scales identical" if ok else "DIFFER")
def us(f, n=300):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
x = case(128, 256, "rand")
print(f"[128, 256] bf16, both usages: torch path {us(lambda: quantize(x, 'blockwise', block='1x128')):.0f} us, "
      f"compiled {us(lambda: ext.quant_1x128_both(x)):.0f} us")
for rep in range(3):
    for M, K in ((128, 256), (512, 512)):
        x = case(M, K, "rand")
        print(f"rep {rep} [{M}, {K}]: torch path {us(lambda: quantize(x, 'blockwise', block='1x128'), 200):.0f} us, "
              f"compiled scalar C++ {us(lambda: ext.quant_1x128_both(x), 200):.0f} us")
