// The native decoder's row-wise bf16 ops (see native_elementwise.h).
//
// The decoder dispatched these as ATen ops, ~35 a layer: a norm alone is eight (a cast, pow, mean as sum and
// div, add, rsqrt, mul, a cast back, mul), each a few microseconds of dispatch and allocation whatever its
// size, and those on a gated MLP's wide rows woke the thread pool. Here each is one pass over each row, the
// threads taking whole rows: a one-row SmolLM2 pass went from ~14 ms to ~12, one of 8 sequences x 5 rows from
// ~39 to ~30.5 (docs/results.md).
//
// A row's result is a fixed sequence of operations on that row alone (and, for the norm and rotary, the row's
// own weights and tables), whatever else is in the pass, so the ops are batch-invariant. Rotary and the
// residual add round exactly as ATen does (each bf16 op in float32, rounded to nearest even), so they are the
// Python loop's bit for bit. The norm's mean square is summed in an order of its own (no row of 2,000 random ones
// of SmolLM2's width came out otherwise than ATen's, but nothing promises it) and SiLU takes an exp of its own, so
// those two may round otherwise than ATen's; the Python loop runs these kernels where it must match the native
// decoder (tests/core/test_native.py), as it runs the attention kernel.

#include "native_elementwise.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPECOPS_X86 1
#endif

namespace specops {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGrainElements = 32768;  // a thread's least work (ATen's grain for elementwise ops)

inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as c10::BFloat16 and ATen's vectorized casts round (NaN aside).
inline uint16_t narrow(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

const uint16_t* in(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// fn(first, last) over rows [0, n), rows of `width` elements: whole rows per thread, one thread for small work.
template <typename Fn>
void over_rows(int64_t n, int64_t width, const Fn& fn) {
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)), fn);
}

// ---- plain loops: CPUs without AVX-512 (or SPECOPS_NATIVE_PLAIN=1) ----

float mean_square_plain(const uint16_t* x, int64_t h) {
  float acc[kLanes] = {};
  for (int64_t i = 0; i < h; ++i) {
    const float v = widen(x[i]);
    acc[i % kLanes] += v * v;
  }
  for (int64_t half = kLanes / 2; half > 0; half /= 2)
    for (int64_t j = 0; j < half; ++j) acc[j] += acc[j + half];
  return acc[0] / static_cast<float>(h);
}

float silu_plain(float g) {
  const float t = std::exp(-std::fabs(g));  // e^-|g| <= 1: no overflow either side of 0
  return (g >= 0.0f ? g : g * t) / (1.0f + t);
}

#ifdef SPECOPS_X86
#define SPECOPS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

SPECOPS_AVX512 inline __m512 load(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

SPECOPS_AVX512 inline __m256i round_bf16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16));
}

SPECOPS_AVX512 inline void store(uint16_t* p, __m512 f, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, round_bf16(f));
}

SPECOPS_AVX512 inline __m512 rounded(__m512 f) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_bf16(f)), 16));
}

// -f as ATen's neg: the sign bit flipped (0 - f would turn -0 into +0).
SPECOPS_AVX512 inline __m512 negate(__m512 f) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(f), _mm512_set1_epi32(INT32_MIN)));
}

inline __mmask16 lanes(int64_t left) { return left >= kLanes ? 0xffff : static_cast<__mmask16>((1u << left) - 1); }

SPECOPS_AVX512 float mean_square_avx512(const uint16_t* x, int64_t h) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += kLanes) {
    const __m512 v = load(x + i, lanes(h - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  alignas(64) float sums[kLanes];
  _mm512_store_ps(sums, acc);
  for (int64_t half = kLanes / 2; half > 0; half /= 2)
    for (int64_t j = 0; j < half; ++j) sums[j] += sums[j + half];
  return sums[0] / static_cast<float>(h);
}

SPECOPS_AVX512 void norm_row_avx512(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t h, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < h; i += kLanes) {
    const __mmask16 m = lanes(h - i);
    store(y + i, _mm512_mul_ps(load(w + i, m), rounded(_mm512_mul_ps(load(x + i, m), s))), m);
  }
}

SPECOPS_AVX512 void rotate_row_avx512(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* y,
                                      int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; i += kLanes) {
    // rot(x)[i] = -x[i + half] below half, x[i - half] above; i steps within one half where half % 16 == 0,
    // else the lanes go one at a time (the plain loop's order is the same: each element is one expression).
    const __mmask16 m = lanes(d - i);
    __m512 other;
    if (half % kLanes == 0) {
      other = i < half ? negate(load(x + i + half, m)) : load(x + i - half, m);
    } else {
      alignas(64) float lane[kLanes] = {};
      for (int64_t j = 0; j < kLanes && i + j < d; ++j)
        lane[j] = i + j < half ? -widen(x[i + j + half]) : widen(x[i + j - half]);
      other = _mm512_load_ps(lane);
    }
    const __m512 a = rounded(_mm512_mul_ps(load(x + i, m), load(cos + i, m)));
    const __m512 b = rounded(_mm512_mul_ps(other, load(sin + i, m)));
    store(y + i, _mm512_add_ps(a, b), m);
  }
}

SPECOPS_AVX512 void silu_mul_row_avx512(const uint16_t* gate, const uint16_t* up, uint16_t* y, int64_t width) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 m = lanes(width - i);
    const __m512 g = load(gate + i, m);
    const __m512 t = exp_nonpositive(negate(_mm512_abs_ps(g)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
    const __m512 silu = _mm512_div_ps(_mm512_mask_mul_ps(g, negative, g, t), _mm512_add_ps(one, t));
    store(y + i, _mm512_mul_ps(rounded(silu), load(up + i, m)), m);
  }
}

SPECOPS_AVX512 void add_row_avx512(const uint16_t* x, const uint16_t* y, uint16_t* z, int64_t width) {
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 m = lanes(width - i);
    store(z + i, _mm512_add_ps(load(x + i, m), load(y + i, m)), m);
  }
}
#endif

bool vector_path() {
#ifdef SPECOPS_X86
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && std::getenv("SPECOPS_NATIVE_PLAIN") == nullptr;
  return yes;
#else
  return false;
#endif
}

void check_rows(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), op,
              ": contiguous 2-d bf16 rows on the CPU");
}

}  // namespace

bool elementwise_vector() { return vector_path(); }

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm_rows");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == h,
              "rms_norm_rows: a bf16 weight of the rows' width");
  at::Tensor y = at::empty_like(x);
  const uint16_t *xs = in(x), *w = in(weight);
  uint16_t* ys = out(y);
  const float epsilon = static_cast<float>(eps);
  over_rows(n, h, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const uint16_t* row = xs + r * h;
#ifdef SPECOPS_X86
      if (vector_path()) {
        norm_row_avx512(row, w, ys + r * h, h, 1.0f / std::sqrt(mean_square_avx512(row, h) + epsilon));
        continue;
      }
#endif
      const float scale = 1.0f / std::sqrt(mean_square_plain(row, h) + epsilon);
      for (int64_t i = 0; i < h; ++i) ys[r * h + i] = narrow(widen(w[i]) * widen(narrow(widen(row[i]) * scale)));
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotate_rows(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "rotate_rows");
  check_rows(cos, "rotate_rows");
  check_rows(sin, "rotate_rows");
  const int64_t n = qkv.size(0), d = cos.size(1), width = qkv.size(1);
  TORCH_CHECK(width == (heads + 2 * kv_heads) * d && d % 2 == 0 && cos.size(0) == n && sin.sizes() == cos.sizes(),
              "rotate_rows: rows of (heads + 2 kv_heads) x D and tables [rows, D]");
  at::Tensor q = at::empty({heads, n, d}, qkv.options()), k = at::empty({kv_heads, n, d}, qkv.options()),
             v = at::empty({kv_heads, n, d}, qkv.options());
  const uint16_t *xs = in(qkv), *cs = in(cos), *ss = in(sin);
  uint16_t *qs = out(q), *ks = out(k), *vs = out(v);
  over_rows(n, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        const uint16_t* x = xs + r * width + head * d;
        const uint16_t *c = cs + r * d, *s = ss + r * d;
        uint16_t* y = head < heads ? qs + (head * n + r) * d : ks + ((head - heads) * n + r) * d;
#ifdef SPECOPS_X86
        if (vector_path()) {
          rotate_row_avx512(x, c, s, y, d);
          continue;
        }
#endif
        for (int64_t i = 0; i < d; ++i) {
          const float other = i < d / 2 ? -widen(x[i + d / 2]) : widen(x[i - d / 2]);
          y[i] = narrow(widen(narrow(widen(x[i]) * widen(c[i]))) + widen(narrow(other * widen(s[i]))));
        }
      }
      for (int64_t head = 0; head < kv_heads; ++head)
        std::memcpy(vs + (head * n + r) * d, xs + r * width + (heads + kv_heads + head) * d, d * sizeof(uint16_t));
    }
  });
  return {q, k, v};
}

at::Tensor silu_mul_rows(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul_rows");
  const int64_t n = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul_rows: rows of gate and up, side by side");
  at::Tensor y = at::empty({n, width}, gate_up.options());
  const uint16_t* xs = in(gate_up);
  uint16_t* ys = out(y);
  over_rows(n, 2 * width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const uint16_t *gate = xs + 2 * r * width, *up = gate + width;
#ifdef SPECOPS_X86
      if (vector_path()) {
        silu_mul_row_avx512(gate, up, ys + r * width, width);
        continue;
      }
#endif
      for (int64_t i = 0; i < width; ++i)
        ys[r * width + i] = narrow(widen(narrow(silu_plain(widen(gate[i])))) * widen(up[i]));
    }
  });
  return y;
}

at::Tensor add_rows(const at::Tensor& x, const at::Tensor& y) {
  check_rows(x, "add_rows");
  check_rows(y, "add_rows");
  TORCH_CHECK(x.sizes() == y.sizes(), "add_rows: rows of one shape");
  const int64_t n = x.size(0), width = x.size(1);
  at::Tensor z = at::empty_like(x);
  const uint16_t *xs = in(x), *ys = in(y);
  uint16_t* zs = out(z);
  over_rows(n, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
#ifdef SPECOPS_X86
      if (vector_path()) {
        add_row_avx512(xs + r * width, ys + r * width, zs + r * width, width);
        continue;
      }
#endif
      for (int64_t i = 0; i < width; ++i)
        zs[r * width + i] = narrow(widen(xs[r * width + i]) + widen(ys[r * width + i]));
    }
  });
  return z;
}

}  // namespace specops
