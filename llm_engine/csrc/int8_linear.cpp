// Weight-only int8 matmul for the few rows of a decode step: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k].
// A decode step is bound by reading weights, so each int8 weight is read once, widened to fp32 in registers and
// used by every row of x; the arithmetic is fp32. Loaded by llm_engine.precision (compiled on first use, cached).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

constexpr int RB = 4;   // rows of x per pass: U * RB accumulators stay in registers

// the portable path: any CPU, and the reference the vector path is tested against
static void block_generic(const float* x, int64_t M, int64_t K, const int8_t* w, const float* sc, float* y,
                          int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(wr[k]);
      y[m * N + n] = acc * sc[n];
    }
  }
}

#if defined(__AVX512F__)
// one weight row against R rows of x (R known at compile time, so the accumulators live in registers); K % 16 == 0.
// Weight rows are walked one after another, so the weights stream sequentially (the hardware prefetcher sees one
// stream per thread; interleaving rows measured 2x slower at one row of x), and U chains over k hide the FMA latency
constexpr int U = 4;
template <int R>
static void row_avx512(const float* x, int64_t K, const int8_t* wr, float s, float* y, int64_t N) {
  __m512 acc[U][R];
  for (int u = 0; u < U; ++u) for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U)
    for (int u = 0; u < U; ++u) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + k + 16 * u))));
      for (int r = 0; r < R; ++r) acc[u][r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k + 16 * u), acc[u][r]);
    }
  for (; k < K; k += 16) {
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + k))));
    for (int r = 0; r < R; ++r) acc[0][r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k), acc[0][r]);
  }
  for (int r = 0; r < R; ++r) {
    __m512 t = acc[0][r];
    for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, acc[u][r]);
    y[r * N] = _mm512_reduce_add_ps(t) * s;
  }
}

static void block_avx512(const float* x, int64_t M, int64_t K, const int8_t* w, const float* sc, float* y,
                         int64_t N, int64_t n0, int64_t n1) {
  static void (*const rows[RB + 1])(const float*, int64_t, const int8_t*, float, float*, int64_t) =
      {nullptr, row_avx512<1>, row_avx512<2>, row_avx512<3>, row_avx512<4>};
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; m += RB)   // the weight row stays in L1 while every group of rows passes over it
      rows[std::min<int64_t>(RB, M - m)](x + m * K, K, w + n * K, sc[n], y + m * N + n, N);
}
#endif

static bool has_vector_path() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [M, K] fp32 or bf16, w [N, K] int8, scales [N] -> [M, N] in x's dtype (the arithmetic is fp32). generic: use the portable loop even where AVX-512 is compiled in
at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& scales_, bool generic) {
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 2 && x_.size(1) == w_.size(1), "int8_linear: x [M, K] and w [N, K] must share K");
  TORCH_CHECK(w_.scalar_type() == at::kChar, "int8_linear: w must be int8");
  TORCH_CHECK(scales_.numel() == w_.size(0), "int8_linear: one scale per output channel");
  const at::Tensor x = x_.to(at::kFloat).contiguous(), w = w_.contiguous(), sc = scales_.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>(); const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const bool vec = !generic && has_vector_path() && K % 16 == 0;
  // each thread takes one contiguous range of output channels: one sequential stream of weights
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
    if (vec) { block_avx512(xp, M, K, wp, sp, yp, N, n0, n1); return; }
#endif
    block_generic(xp, M, K, wp, sp, yp, N, n0, n1);
  });
  return x_.scalar_type() == at::kFloat ? y : y.to(x_.scalar_type());
}

bool int8_linear_vectorized() { return has_vector_path(); }

TORCH_LIBRARY_FRAGMENT(llm_engine, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, bool generic=False) -> Tensor");
  m.def("int8_linear_vectorized() -> bool", &int8_linear_vectorized);
}
TORCH_LIBRARY_IMPL(llm_engine, CPU, m) { m.impl("int8_linear", int8_linear); }
