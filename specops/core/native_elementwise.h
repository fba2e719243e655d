// The native decoder's row-wise bf16 ops: RMSNorm, rotary and the gated MLP's SiLU, each one pass over a row
// (native_elementwise.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specops {

// llama.rms_norm of bf16 rows x [n, H] by weight [H]: each row's mean square in float32, summed in a fixed
// order of its own (16 interleaved partial sums, then halves); the rest as the Python loop rounds it.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps);

// The Python loop's rotary, bit for bit, on a product's bf16 rows qkv [n, (heads + 2 kv_heads) D] with the
// rows' tables cos, sin [n, D]: q [heads, n, D] and k [kv_heads, n, D] rotated, v [kv_heads, n, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotate_rows(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t heads, int64_t kv_heads);

// silu(gate) * up of bf16 rows gate_up [n, 2I] (gate its first half): silu in float32 with an exp of this
// file's own, rounded to bf16, times up, rounded again.
at::Tensor silu_mul_rows(const at::Tensor& gate_up);

// x + y of bf16 rows, as ATen adds them (in float32, rounded once).
at::Tensor add_rows(const at::Tensor& x, const at::Tensor& y);

// Whether these ops and attention (native_attention.cpp) take their AVX-512 loops here (AVX-512 F, BW and VL),
// else plain loops (SPECOPS_NATIVE_PLAIN=1 forces them), whose SiLU takes libm's exp and so rounds otherwise: a
// CPU runs one or the other.
bool elementwise_vector();

#if defined(__x86_64__)
// e^x for x <= 0 (a softmax's inputs less their max; SiLU's e^-|g|): Cephes' expf, 2^n * p(r) with r = x - n ln 2.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}
#endif

}  // namespace specops
