// The decode step's own CPU kernels (loaded by llm_engine.precision; compiled on first use, cached):
// - int8_linear: weight-only int8 matmul for the few rows of a decode step, y[m, n] = scale[n] * sum_k x[m, k] * w[n, k].
//   A decode step is bound by reading weights, so each int8 weight is read once, widened to fp32 in registers and
//   used by every row of x; the arithmetic is fp32. Under AVX2, bf16 and int8 weights take it up to 128 rows
//   (pair_avx2: two weight rows at a time), where it beats MKL on weights widened per call.
// - add_rms_norm, rope_store, silu_mul: the small operations between a layer's matmuls, one call each instead of
//   five to ten PyTorch calls, for fp32 or bf16 activations (arithmetic in fp32, results rounded to the activations' dtype).
// - q4_linear: the same for 4-bit weights in GGUF's Q4_1 blocks (a scale and a minimum per 32 weights); on AVX2 the
//   activations of up to 3 rows are rounded to 16 bits per block of 32 and the products are 8-bit integer multiply-adds.
// - decode_layers: every decoder layer of a decode step for a few rows in one call (decode_layer: one of them), weights
//   Q4, int8 (with scales), bf16 or fp32; q/k/v biases where the family has them (Qwen2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>
#include <ATen/core/dispatch/Dispatcher.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// The ISA is fixed when the file is compiled (notebook 00's CPU_ISA: -march=x86-64-v4 or -v3): AVX-512 paths where
// __AVX512F__, AVX2 + FMA + F16C paths where only those, the portable loops everywhere (and as the tests' reference)
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLM_AVX2 1
#endif

constexpr int RB = 4;   // rows of x per pass: U * RB accumulators stay in registers

// the files are built with -ffast-math, which may fold std::isfinite / std::isnan away: the exponent's bits say it
static inline bool nonfinite(float v) { uint32_t b; std::memcpy(&b, &v, 4); return (b & 0x7f800000u) == 0x7f800000u; }
static inline float quiet_nan() { const uint32_t b = 0x7fc00000u; float v; std::memcpy(&v, &b, 4); return v; }

// weights: int8 (with one scale per output channel), bf16 or fp32 (scales null: 1); always widened to fp32
template <typename W> static inline float wf(const W* p, int64_t i) { return static_cast<float>(p[i]); }

// the portable path: any CPU, and the reference the vector path is tested against
template <typename W>
static void block_generic(const float* x, int64_t M, int64_t K, const W* w, const float* sc, float* y,
                          int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * wf(wr, k);
      y[m * N + n] = sc ? acc * sc[n] : acc;
    }
  }
}

#if defined(__AVX512F__) || defined(LLM_AVX2)
// The hardware prefetcher alone kept a one-row step well below the memory's bandwidth: each weight row is a few KB,
// and the widening arithmetic between loads left too few misses in flight. Asking for the line WEIGHT_PREFETCH bytes
// ahead (the next row's, near a row's end) measured, TinyLlama-1.1B's 88 int8 matmuls at one row streamed from
// memory: 15.7 -> 18.6 GB/s on AVX-512, 11.5 -> 17.5 GB/s under AVX2 (the stream alone: 25 and 23). The Q4 kernels
// below take the same distance (it was 256 bytes: their 88 matmuls 48.4 -> 35.9 ms on AVX-512, 92.0 -> 64.4 under AVX2)
constexpr int64_t WEIGHT_PREFETCH = 2048;
// one prefetch per cache line of the n weights at w (one for less than a line)
template <int n, typename W> static inline void prefetch_ahead(const W* w) {
  constexpr int lines = n * (int)sizeof(W) / 64 > 0 ? n * (int)sizeof(W) / 64 : 1;
  for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)w + 64 * l + WEIGHT_PREFETCH, _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)
// 16 weights widened to fp32
static inline __m512 widen16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline __m512 widen16(const at::BFloat16* p) {     // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

// one weight row against R rows of x (R known at compile time, so the accumulators live in registers); K % 16 == 0.
// Weight rows are walked one after another, so the weights stream sequentially (the hardware prefetcher sees one
// stream per thread; interleaving rows measured 2x slower at one row of x), and U chains over k hide the FMA latency
constexpr int U = 4;
template <int R, typename W>
static void row_avx512(const float* x, int64_t K, const W* wr, float s, float* y, int64_t N) {
  __m512 acc[U][R];
  for (int u = 0; u < U; ++u) for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    prefetch_ahead<16 * U>(wr + k);
    for (int u = 0; u < U; ++u) {
      const __m512 wv = widen16(wr + k + 16 * u);
      for (int r = 0; r < R; ++r) acc[u][r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k + 16 * u), acc[u][r]);
    }
  }
  for (; k < K; k += 16) {
    const __m512 wv = widen16(wr + k);
    for (int r = 0; r < R; ++r) acc[0][r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k), acc[0][r]);
  }
  for (int r = 0; r < R; ++r) {
    __m512 t = acc[0][r];
    for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, acc[u][r]);
    y[r * N] = _mm512_reduce_add_ps(t) * s;
  }
}

template <typename W>
static void block_avx512(const float* x, int64_t M, int64_t K, const W* w, const float* sc, float* y,
                         int64_t N, int64_t n0, int64_t n1) {
  static void (*const rows[RB + 1])(const float*, int64_t, const W*, float, float*, int64_t) =
      {nullptr, row_avx512<1, W>, row_avx512<2, W>, row_avx512<3, W>, row_avx512<4, W>};
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; m += RB)   // the weight row stays in L1 while every group of rows passes over it
      rows[std::min<int64_t>(RB, M - m)](x + m * K, K, w + n * K, sc ? sc[n] : 1.f, y + m * N + n, N);
}
#endif

#if defined(LLM_AVX2)
// The same for AVX2: 8 lanes and 16 registers, so R = 3 or 4 rows of x keep two chains over k (8 accumulators)
// and fewer rows keep four
static inline __m256 widen8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline __m256 widen8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
static inline float hsum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int R, typename W>
static void row_avx2(const float* x, int64_t K, const W* wr, float s, float* y, int64_t N) {
  constexpr int V = R <= 2 ? 4 : 2;
  __m256 acc[V][R];
  for (int u = 0; u < V; ++u) for (int r = 0; r < R; ++r) acc[u][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * V <= K; k += 8 * V) {
    prefetch_ahead<8 * V>(wr + k);
    for (int u = 0; u < V; ++u) {
      const __m256 wv = widen8(wr + k + 8 * u);
      for (int r = 0; r < R; ++r) acc[u][r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k + 8 * u), acc[u][r]);
    }
  }
  for (; k < K; k += 8) {
    const __m256 wv = widen8(wr + k);
    for (int r = 0; r < R; ++r) acc[0][r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[0][r]);
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[0][r];
    for (int u = 1; u < V; ++u) t = _mm256_add_ps(t, acc[u][r]);
    y[r * N] = hsum8(t) * s;
  }
}

template <typename W>
static void block_avx2(const float* x, int64_t M, int64_t K, const W* w, const float* sc, float* y,
                       int64_t N, int64_t n0, int64_t n1) {
  static void (*const rows[RB + 1])(const float*, int64_t, const W*, float, float*, int64_t) =
      {nullptr, row_avx2<1, W>, row_avx2<2, W>, row_avx2<3, W>, row_avx2<4, W>};
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; m += RB)
      rows[std::min<int64_t>(RB, M - m)](x + m * K, K, w + n * K, sc ? sc[n] : 1.f, y + m * N + n, N);
}
#endif

#if defined(LLM_AVX2)
// bf16 and int8 weights for more rows (AVX2 has no bf16 arithmetic, and a batch of 32 decode rows lands here):
// widening a row with a shift costs one uop on the FMA ports for every FMA-sized load, and re-reading the four rows
// of x for every weight row leaves one load per FMA. Two weight rows at a time (each x load serves both) widened by
// interleaving with zero (vpunpcklwd / vpunpckhwd: port 5 only) take both costs off the FMA ports. The interleave
// yields weights 0-3 and 8-11 of 16 (then 4-7, 12-15), so x is copied once per call into that order
// (perm_rows). bf16 interleaved under zero is its fp32 value; int8, sign-extended to 16 bits first, becomes
// its value times 2^16 as an int32, exact in fp32 (PairWeights::unit folds the 2^16 into the row's scale).
template <typename W> struct PairWeights;
template <> struct PairWeights<at::BFloat16> {
  static constexpr float unit = 1.f;
  static __m256i load(const at::BFloat16* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static __m256 half(__m256i v, int h) { const __m256i z = _mm256_setzero_si256(); return _mm256_castsi256_ps(h ? _mm256_unpackhi_epi16(z, v) : _mm256_unpacklo_epi16(z, v)); }
};
template <> struct PairWeights<int8_t> {
  static constexpr float unit = 1.f / 65536.f;
  static __m256i load(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
  static __m256 half(__m256i v, int h) { const __m256i z = _mm256_setzero_si256(); return _mm256_cvtepi32_ps(h ? _mm256_unpackhi_epi16(z, v) : _mm256_unpacklo_epi16(z, v)); }
};
constexpr int PAIR_MIN_ROWS = 4;            // rows from which the pair kernel runs (below: row_avx2, bandwidth-bound)
constexpr int64_t PAIR_N_BLOCK = 64;        // weight rows kept in L2 while every group of x rows passes over them
constexpr int64_t PAIR_K_BLOCK = 2048;      // and columns: four rows of x, 32 KB, stay in L1
static void perm_rows(const float* x, int64_t M, int64_t K, float* xp) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16) {
      const float* s = x + m * K + k; float* d = xp + m * K + k;
      for (int i = 0; i < 4; ++i) { d[i] = s[i]; d[4 + i] = s[8 + i]; d[8 + i] = s[4 + i]; d[12 + i] = s[12 + i]; }
    }
}

template <typename W, int P, int R>     // P weight rows (1 or 2) by R rows of x (1-4): P * R accumulators, over k0 <= k < k1
static void pair_avx2(const float* xp, int64_t K, const W* w, const float* sc, float* y, int64_t N, int64_t k0, int64_t k1) {
  __m256 acc[P][R];
  for (int p = 0; p < P; ++p) for (int r = 0; r < R; ++r) acc[p][r] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += 16) {
    __m256i wv[P];
    for (int p = 0; p < P; ++p) wv[p] = PairWeights<W>::load(w + p * K + k);
    for (int half = 0; half < 2; ++half) {
      __m256 wf[P];
      for (int p = 0; p < P; ++p) wf[p] = PairWeights<W>::half(wv[p], half);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(xp + r * K + k + 8 * half);
        for (int p = 0; p < P; ++p) acc[p][r] = _mm256_fmadd_ps(wf[p], xv, acc[p][r]);
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    const float s = (sc ? sc[p] : 1.f) * PairWeights<W>::unit;
    for (int r = 0; r < R; ++r) y[r * N + p] = (k0 ? y[r * N + p] : 0.f) + hsum8(acc[p][r]) * s;
  }
}

template <typename W>
static void block_pairs_avx2(const float* xp, int64_t M, int64_t K, const W* w, const float* sc, float* y,
                             int64_t N, int64_t n0, int64_t n1) {
  using F = void (*)(const float*, int64_t, const W*, const float*, float*, int64_t, int64_t, int64_t);
  static const F two[5] = {nullptr, pair_avx2<W, 2, 1>, pair_avx2<W, 2, 2>, pair_avx2<W, 2, 3>, pair_avx2<W, 2, 4>};
  static const F one[5] = {nullptr, pair_avx2<W, 1, 1>, pair_avx2<W, 1, 2>, pair_avx2<W, 1, 3>, pair_avx2<W, 1, 4>};
  for (int64_t b = n0; b < n1; b += PAIR_N_BLOCK) {
    const int64_t e = std::min(n1, b + PAIR_N_BLOCK);
    for (int64_t k0 = 0; k0 < K; k0 += PAIR_K_BLOCK) {
      const int64_t k1 = std::min(K, k0 + PAIR_K_BLOCK);
      for (int64_t m = 0; m < M; m += RB) {
        const int r = (int)std::min<int64_t>(RB, M - m);
        int64_t n = b;
        for (; n + 2 <= e; n += 2) two[r](xp + m * K, K, w + n * K, sc ? sc + n : nullptr, y + m * N + n, N, k0, k1);
        if (n < e) one[r](xp + m * K, K, w + n * K, sc ? sc + n : nullptr, y + m * N + n, N, k0, k1);
      }
    }
  }
}
#endif

static bool has_vector_path() {
#if defined(__AVX512F__) || defined(LLM_AVX2)
  return true;
#else
  return false;
#endif
}

// the vector path this library was built with, for the tests and the logs
static std::string kernel_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(LLM_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

// y [M, N] = x [M, K] (fp32) times the weight [N, K] (int8 with scales, bf16 or fp32), each thread taking one contiguous range of output channels:
// one sequential stream of weights per thread
template <typename W>
static void matmul_into(const float* xp, int64_t M, int64_t K, const W* wp, const float* sp, float* yp, int64_t N,
                        bool generic) {
  const bool vec = !generic && has_vector_path() && K % 16 == 0;
#if defined(LLM_AVX2)
  if constexpr (std::is_same_v<W, at::BFloat16> || std::is_same_v<W, int8_t>) {
    if (vec && M >= PAIR_MIN_ROWS) {
      // grown once and kept, not a zero-filled allocation per call; the workers get its pointer (a thread_local named
      // inside the lambda would be each worker's own, empty one)
      thread_local std::vector<float> xperm;
      if (xperm.size() < size_t(M * K)) xperm.resize(M * K);
      float* xq = xperm.data();
      perm_rows(xp, M, K, xq);
      at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) { block_pairs_avx2(xq, M, K, wp, sp, yp, N, n0, n1); });
      return;
    }
  }
#endif
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
    if (vec) { block_avx512(xp, M, K, wp, sp, yp, N, n0, n1); return; }
#elif defined(LLM_AVX2)
    if (vec) { block_avx2(xp, M, K, wp, sp, yp, N, n0, n1); return; }
#endif
    block_generic(xp, M, K, wp, sp, yp, N, n0, n1);
  });
}

// x [M, K] fp32 or bf16, w [N, K] int8 with scales [N], or bf16 / fp32 with no scales -> [M, N] in x's dtype (the
// arithmetic is fp32). generic: use the portable loop even where a vector path is compiled in
at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& scales_, bool generic) {
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 2 && x_.size(1) == w_.size(1), "int8_linear: x [M, K] and w [N, K] must share K");
  const auto wt = w_.scalar_type();
  TORCH_CHECK(wt == at::kChar || wt == at::kBFloat16 || wt == at::kFloat, "int8_linear: w must be int8, bf16 or fp32");
  TORCH_CHECK(wt == at::kChar ? scales_.numel() == w_.size(0) : scales_.numel() == 0, "int8_linear: one scale per output channel for int8, none otherwise");
  const at::Tensor x = x_.to(at::kFloat).contiguous(), w = w_.contiguous(), sc = scales_.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>();
  if (wt == at::kChar) matmul_into(xp, M, K, w.data_ptr<int8_t>(), sc.data_ptr<float>(), yp, N, generic);
  else if (wt == at::kBFloat16) matmul_into(xp, M, K, w.data_ptr<at::BFloat16>(), (const float*)nullptr, yp, N, generic);
  else matmul_into(xp, M, K, w.data_ptr<float>(), (const float*)nullptr, yp, N, generic);
  return x_.scalar_type() == at::kFloat ? y : y.to(x_.scalar_type());
}

// ---- 4-bit weights: GGUF's Q4_1 blocks of 32 weights along k, each a scale d and a minimum m (fp16) and 32 4-bit q,
// weight = d q + m. Weights de-quantized from a Q4_1 file (the embedded model's layers) are held exactly, in 0.625
// bytes per weight against int8's 1: a decode step streams its weights, so fewer bytes is a faster step.
// A row of K weights (K a multiple of 64, G = K / 32 blocks) is laid out for the kernel rather than as the file has it:
// first the G (d, m) pairs (4 bytes each), then the blocks two by two, 32 bytes per pair: byte 2j is block 2p's byte j
// (its weight j in the low nibble, weight j + 16 in the high one, as in the file) and byte 2j + 1 block 2p + 1's byte j.
// So one 16-bit lane holds the four nibbles of weight j of both blocks, and one widening load serves 64 weights.
constexpr int64_t Q4_GROUP = 32, Q4_BYTES = 20;

static inline float half_bits(const uint8_t* p) {
  uint16_t h; std::memcpy(&h, p, 2); return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// the Q4 vector kernels' outer loop: each weight row n of [n0, n1) against the rows of x RB at a time, while the
// weight row stays in L1; row(n, m, rows, dm) runs one group (dm: the thread's room for a row's (d, m) pairs in fp32)
template <typename Row>
static void q4_row_groups(int64_t M, int64_t K, int64_t n0, int64_t n1, Row&& row) {
  thread_local std::vector<float> dm;
  dm.resize(2 * K / Q4_GROUP);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; m += RB) row(n, m, std::min<int64_t>(RB, M - m), dm.data());
}

static void block_q4_generic(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / Q4_GROUP;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      const uint8_t *row = w + n * G * Q4_BYTES, *qs = row + 4 * G;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const float d = half_bits(row + 4 * g), mn = half_bits(row + 4 * g + 2), *xr = x + m * K + g * Q4_GROUP;
        const uint8_t* b = qs + 32 * (g / 2) + g % 2;
        for (int j = 0; j < 16; ++j) acc += xr[j] * (d * (b[2 * j] & 15) + mn) + xr[j + 16] * (d * (b[2 * j] >> 4) + mn);
      }
      y[m * N + n] = acc;
    }
}

#if defined(__AVX512F__)
// A block's 16 possible weights, d * [0..15] + m, are a table of 16 floats, one register: vpermps looks each 4-bit q
// up in it (it reads only an index's low 4 bits, so a shift is all a nibble needs), with no int-to-float conversion.
// d q + m is one rounding, as the de-quantizer computes it: the weights multiplied are bit for bit the fp32 ones.
template <int R>
static void row_q4_avx512(const float* x, int64_t K, const uint8_t* wr, float* y, int64_t N, float* dm) {
  const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  const int64_t G = K / Q4_GROUP;
  int64_t i = 0;     // the row's (d, m) to fp32 first, 8 pairs per conversion; the blocks then broadcast them from memory
  for (; i + 16 <= 2 * G; i += 16) _mm512_storeu_ps(dm + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wr + 2 * i))));
  for (; i < 2 * G; ++i) dm[i] = half_bits(wr + 2 * i);
  const uint8_t* qs = wr + 4 * G;
  __m512 acc[4][R];
  for (int u = 0; u < 4; ++u) for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < G / 2; ++p) {
    _mm_prefetch((const char*)(qs + 32 * p + WEIGHT_PREFETCH), _MM_HINT_T0);
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(qs + 32 * p)));
    const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[4 * p]), _mm512_set1_ps(dm[4 * p + 1]));
    const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[4 * p + 2]), _mm512_set1_ps(dm[4 * p + 3]));
    const __m512 w[4] = {_mm512_permutexvar_ps(v, t0), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t0),
                         _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), t1), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), t1)};
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[u][r] = _mm512_fmadd_ps(w[u], _mm512_loadu_ps(x + r * K + 64 * p + 16 * u), acc[u][r]);
  }
  for (int r = 0; r < R; ++r)
    y[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]), _mm512_add_ps(acc[2][r], acc[3][r])));
}

static void block_q4_avx512(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  static void (*const rows[RB + 1])(const float*, int64_t, const uint8_t*, float*, int64_t, float*) =
      {nullptr, row_q4_avx512<1>, row_q4_avx512<2>, row_q4_avx512<3>, row_q4_avx512<4>};
  q4_row_groups(M, K, n0, n1, [&](int64_t n, int64_t m, int64_t r, float* dm) {
    rows[r](x + m * K, K, w + n * K / Q4_GROUP * Q4_BYTES, y + m * N + n, N, dm); });
}
#endif

#if defined(LLM_AVX2)
// AVX2 has no 16-entry table lookup in one register (vpermps reads 3 bits), so the nibbles are widened to fp32 and
// d q + m is one fused multiply-add: the same single rounding as the AVX-512 table, so the same fp32 weights.
// A pair of blocks is two 16-byte halves (weights j = 8h..8h+7 of both blocks); V chains over the four weight groups
// a row's G (d, m) pairs to fp32 into dm, 4 pairs per conversion; the blocks then broadcast them from memory
static inline void q4_scales_avx2(const uint8_t* wr, int64_t G, float* dm) {
  int64_t i = 0;
  for (; i + 8 <= 2 * G; i += 8) _mm256_storeu_ps(dm + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wr + 2 * i))));
  for (; i < 2 * G; ++i) dm[i] = half_bits(wr + 2 * i);
}

template <int R>
static void row_q4_avx2(const float* x, int64_t K, const uint8_t* wr, float* y, int64_t N, float* dm) {
  constexpr int V = R <= 2 ? 4 : 2;
  const int64_t G = K / Q4_GROUP;
  q4_scales_avx2(wr, G, dm);
  const uint8_t* qs = wr + 4 * G;
  const __m256i low4 = _mm256_set1_epi32(15);
  __m256 acc[V][R];
  for (int u = 0; u < V; ++u) for (int r = 0; r < R; ++r) acc[u][r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < G / 2; ++p) {
    _mm_prefetch((const char*)(qs + 32 * p + WEIGHT_PREFETCH), _MM_HINT_T0);
    const __m256 dA = _mm256_set1_ps(dm[4 * p]), mA = _mm256_set1_ps(dm[4 * p + 1]);
    const __m256 dB = _mm256_set1_ps(dm[4 * p + 2]), mB = _mm256_set1_ps(dm[4 * p + 3]);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(qs + 32 * p + 16 * h)));
      const __m256 w[4] = {_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), dA, mA),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), low4)), dA, mA),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), low4)), dB, mB),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 12)), dB, mB)};
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < 4; ++u) {
          __m256& a = acc[(u + 2 * h) % V][r];
          a = _mm256_fmadd_ps(w[u], _mm256_loadu_ps(x + r * K + 64 * p + 16 * u + 8 * h), a);
        }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[0][r];
    for (int u = 1; u < V; ++u) t = _mm256_add_ps(t, acc[u][r]);
    y[r * N] = hsum8(t);
  }
}

static void block_q4_avx2(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  static void (*const rows[RB + 1])(const float*, int64_t, const uint8_t*, float*, int64_t, float*) =
      {nullptr, row_q4_avx2<1>, row_q4_avx2<2>, row_q4_avx2<3>, row_q4_avx2<4>};
  q4_row_groups(M, K, n0, n1, [&](int64_t n, int64_t m, int64_t r, float* dm) {
    rows[r](x + m * K, K, w + n * K / Q4_GROUP * Q4_BYTES, y + m * N + n, N, dm); });
}
#endif

#if defined(LLM_AVX2)
// That widening, three instructions per 8 weights before the multiply-add, bounds a one-row step (TinyLlama-1.1B's
// 88 matmuls: 66 ms, 9 GB/s of Q4 bytes where the memory gives 25-30). For up to Q4_INT_ROWS rows the AVX2 build
// multiplies in integers instead: each activation becomes 16 bits held as two int8 (x / d_x = hi + lo / 254, d_x =
// max|x| / 127 per block of 32, the weights' blocks), and the nibbles meet both bytes in 8-bit multiply-adds
// (vpmaddubsw: unsigned nibble times signed byte, pairs added in 16 bits, at most 2 x 15 x 127, so nothing
// saturates; vpmaddwd then adds pairs into 32 bits, weighting hi's by 254). A block's sum is
// d_w d_x / 254 sum(q_w (254 hi + lo)) + m_w sum(x): the minimum meets the block's exact fp32 sum, and the
// activations are rounded by at most max|x| / 64,516 (a 1e-4 relative bound in the tests; one byte alone, as
// llama.cpp's Q8_1, rounded SmolLM2's greedy choice off fp32's at 2.7% of positions against 1% with fp32). The same
// 88 matmuls: 36.6 ms at one row, 60.2 at two, 62.1 at three, 81.1 at four (fp32: 66.0, 69.2, 77.8, 80.1).
// The activations of each row, per pair of blocks (A = 2p, B = 2p + 1) in the order the weights' nibbles come out of
// one vpshufb of the pair's 32 bytes: hi's 32 bytes against the low nibbles (A's weights 0-7, B's 0-7, A's 8-15, B's
// 8-15), 32 against the high ones (16-23, ..., 24-31), then lo's 64 the same way; then 8 scales (d_x / 254) and 8
// sums laid out as the 32-bit lanes of the product are (A, A, B, B, A, A, B, B), each sum a quarter of its block's
// (4 lanes add it up again, exactly)
constexpr int64_t Q4_INT_ROWS = 3;
struct Q16Acts { std::vector<int8_t> q; std::vector<float> d, s; };

static void quantize_q16_pairs(const float* x, int64_t M, int64_t K, Q16Acts& a) {
  const int64_t P = K / (2 * Q4_GROUP);
  a.q.resize(2 * M * K); a.d.resize(M * P * 8); a.s.resize(M * P * 8);
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t p = 0; p < P; ++p) {
      float d[2], sum[2];
      int8_t* q = a.q.data() + 2 * m * K + 128 * p;
      for (int b = 0; b < 2; ++b) {
        const float* xb = x + m * K + 64 * p + 32 * b;
        float amax = 0.f, s = 0.f, sa = 0.f;
        for (int j = 0; j < 32; ++j) { amax = std::max(amax, std::fabs(xb[j])); s += xb[j]; sa += std::fabs(xb[j]); }
        if (nonfinite(sa)) d[b] = sum[b] = quiet_nan();
        else { d[b] = amax / 127.f; sum[b] = s; }
        const float inv = d[b] > 0.f ? 1.f / d[b] : 0.f;     // a NaN scale quantizes to zeros and multiplies in the NaN
        for (int j = 0; j < 32; ++j) {
          const int at = (j >= 16 ? 32 : 0) + (j % 16) / 8 * 16 + 8 * b + j % 8;
          const float v = std::min(127.f, std::max(-127.f, xb[j] * inv)), hi = std::nearbyint(v);
          q[at] = static_cast<int8_t>(hi);
          q[64 + at] = static_cast<int8_t>(std::nearbyint((v - hi) * 254.f));
        }
      }
      float* dp = a.d.data() + (m * P + p) * 8; float* sp = a.s.data() + (m * P + p) * 8;
      for (int l = 0; l < 8; ++l) { dp[l] = d[l % 4 / 2] / 254.f; sp[l] = sum[l % 4 / 2] * 0.25f; }
    }
  });
}

template <int R>
static void row_q4q16_avx2(const Q16Acts& a, int64_t m0, int64_t K, const uint8_t* wr, float* y, int64_t N, float* dm) {
  constexpr int V = R <= 2 ? 2 : 1;
  const int64_t G = K / Q4_GROUP, P = G / 2;
  q4_scales_avx2(wr, G, dm);
  const uint8_t* qs = wr + 4 * G;
  const int8_t* xq = a.q.data() + 2 * m0 * K; const float *xd = a.d.data() + m0 * P * 8, *xs = a.s.data() + m0 * P * 8;
  const __m256i shuf = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), hi_weight = _mm256_set1_epi16(254);
  __m256 acc[V][R], accm[R];
  for (int r = 0; r < R; ++r) { accm[r] = _mm256_setzero_ps(); for (int u = 0; u < V; ++u) acc[u][r] = _mm256_setzero_ps(); }
  for (int64_t p = 0; p < P; ++p) {
    _mm_prefetch((const char*)(qs + 32 * p + WEIGHT_PREFETCH), _MM_HINT_T0);
    const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(qs + 32 * p)), shuf);
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256 dmv = _mm256_broadcast_ps((const __m128*)(dm + 4 * p));        // dA mA dB mB, in both halves
    const __m256 dw = _mm256_permute_ps(dmv, 0xA0), mw = _mm256_permute_ps(dmv, 0xF5);   // (dA dA dB dB), (mA mA mB mB)
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + 2 * r * K + 128 * p;
      const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xr)),
                                          _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xr + 32))));
      const __m256i s2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(xr + 64))),
                                          _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xr + 96))));
      const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(s1, hi_weight), _mm256_madd_epi16(s2, ones));
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s32), _mm256_loadu_ps(xd + (r * P + p) * 8));
      acc[p % V][r] = _mm256_fmadd_ps(t, dw, acc[p % V][r]);
      accm[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + (r * P + p) * 8), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = accm[r];
    for (int u = 0; u < V; ++u) t = _mm256_add_ps(t, acc[u][r]);
    y[r * N] = hsum8(t);
  }
}

static void block_q4q16_avx2(const Q16Acts& a, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  static void (*const rows[RB + 1])(const Q16Acts&, int64_t, int64_t, const uint8_t*, float*, int64_t, float*) =
      {nullptr, row_q4q16_avx2<1>, row_q4q16_avx2<2>, row_q4q16_avx2<3>, row_q4q16_avx2<4>};
  q4_row_groups(M, K, n0, n1, [&](int64_t n, int64_t m, int64_t r, float* dm) {
    rows[r](a, m, K, w + n * K / Q4_GROUP * Q4_BYTES, y + m * N + n, N, dm); });
}
#endif

static void matmul_q4_into(const float* xp, int64_t M, int64_t K, const uint8_t* wp, float* yp, int64_t N, bool generic) {
#if defined(LLM_AVX2)
  thread_local Q16Acts acts_;       // the calling thread's; the workers below read it through `acts`
  Q16Acts& acts = acts_;
  const bool int_path = M <= Q4_INT_ROWS;
  if (!generic && int_path) quantize_q16_pairs(xp, M, K, acts);
#endif
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
    if (!generic) { block_q4_avx512(xp, M, K, wp, yp, N, n0, n1); return; }
#elif defined(LLM_AVX2)
    if (!generic && int_path) { block_q4q16_avx2(acts, M, K, wp, yp, N, n0, n1); return; }
    if (!generic) { block_q4_avx2(xp, M, K, wp, yp, N, n0, n1); return; }
#endif
    block_q4_generic(xp, M, K, wp, yp, N, n0, n1);
  });
}

// the fp32 weights [N, K] that Q4 rows w stand for (d q + m, one rounding), written into out: a large batch's matmul
// reads them from there (a buffer reused across layers, not a second copy of the model)
// T = float, or bf16 for a large batch's bf16 matmul on a model too big to keep a dequantized copy (each value
// computed in fp32 and rounded once, as the packed copy's `.to(bfloat16)` rounds it)
template <typename T>
static void q4_dequantize_rows(const uint8_t* wp, int64_t N, int64_t G, T* op) {
  const int64_t K = G * Q4_GROUP;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t *row = wp + n * G * Q4_BYTES, *qs = row + 4 * G;
      for (int64_t g = 0; g < G; ++g) {
        const float d = half_bits(row + 4 * g), mn = half_bits(row + 4 * g + 2);
        const uint8_t* b = qs + 32 * (g / 2) + g % 2; T* o = op + n * K + g * Q4_GROUP;
        for (int j = 0; j < 16; ++j) {
          o[j] = static_cast<T>(std::fma(d, (float)(b[2 * j] & 15), mn)); o[j + 16] = static_cast<T>(std::fma(d, (float)(b[2 * j] >> 4), mn));
        }
      }
    }
  });
}

void q4_dequantize(const at::Tensor& w_, at::Tensor out) {
  const at::Tensor w = w_.contiguous();
  const int64_t N = w.size(0), G = w.size(1) / Q4_BYTES, K = G * Q4_GROUP;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) % Q4_BYTES == 0 && G % 2 == 0, "q4_dequantize: Q4 rows [N, K / 32 * 20]");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_contiguous() && out.numel() == N * K,
              "q4_dequantize: out fp32 or bf16 [N, K], contiguous");
  if (out.scalar_type() == at::kFloat) q4_dequantize_rows(w.data_ptr<uint8_t>(), N, G, out.data_ptr<float>());
  else q4_dequantize_rows(w.data_ptr<uint8_t>(), N, G, out.data_ptr<at::BFloat16>());
}

// x [M, K] fp32 or bf16, w [N, K / 32 * 20] uint8 (Q4_1 blocks, laid out as above) -> [M, N] in x's dtype (the arithmetic is fp32)
at::Tensor q4_linear(const at::Tensor& x_, const at::Tensor& w_, bool generic) {
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 2 && x_.size(1) % (2 * Q4_GROUP) == 0 && w_.size(1) == x_.size(1) / Q4_GROUP * Q4_BYTES,
              "q4_linear: x [M, K] (K a multiple of 64) and w [N, K / 32 * 20]");
  TORCH_CHECK(w_.scalar_type() == at::kByte, "q4_linear: w must be uint8");
  const at::Tensor x = x_.to(at::kFloat).contiguous(), w = w_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  matmul_q4_into(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), y.data_ptr<float>(), N, generic);
  return x_.scalar_type() == at::kFloat ? y : y.to(x_.scalar_type());
}

// ---- one whole decoder layer for a decode step (every row one new token), in one call: no Python, no
// temporaries between the small ops. Activations are fp32 inside (the residual and the result come back in the
// activations' dtype T), the K/V cache is T, the weights int8 (with scales), bf16 or fp32.

// The row-wise pieces, shared by the fused layer (T = float) and the small ops below (T = float or bf16): the
// arithmetic is fp32, each result rounded to T where it is stored.
template <typename T> static inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// one row: r = a + b (rounded to T, as PyTorch's add would be; without b, r = a), then out = r RMS-normalised by w.
// r may be a (the residual updated in place)
template <typename T>
static void add_rms_norm_row(const T* a, const T* b, T* r, const float* w, T* out, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    if (b) r[i] = static_cast<T>(ld(a, i) + ld(b, i)); else if (r != a) r[i] = a[i];
    const float v = ld(r, i); ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / H + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = static_cast<T>(ld(r, i) * inv * w[i]);
}

// rotate-half RoPE of one head of width 2 * h2, from x into y (which may be x), by its token's cos / sin [h2]
template <typename S, typename T>
static void rope_head(const S* x, T* y, int64_t h2, const float* c, const float* s) {
  for (int64_t i = 0; i < h2; ++i) {
    const float a = ld(x, i), b = ld(x, i + h2);
    y[i] = static_cast<T>(a * c[i] - b * s[i]); y[i + h2] = static_cast<T>(b * c[i] + a * s[i]);
  }
}

// one row: o = silu(gate) * up, from g = [gate (I), up (I)] as the fused gate_up projection writes them
template <typename T>
static void silu_mul_row(const T* g, T* o, int64_t I) {
  for (int64_t i = 0; i < I; ++i) { const float a = ld(g, i); o[i] = static_cast<T>(a / (1.f + std::exp(-a)) * ld(g, I + i)); }
}

static const float* f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), what, ": contiguous fp32");
  return t.data_ptr<float>();
}

// y [M, N] = x [M, K] times w [N, K]: int8 with scales [N], or bf16 / fp32 (scales empty), or Q4_1 blocks [N, K / 32 * 20],
// or bf16 in oneDNN's packed layout (a model too big for a plain copy beside it): oneDNN's own matmul, on x rounded to
// bf16 as the layer loop rounds it, called through the dispatcher (a few us, where a call from Python costs some 15)
static void mm(const float* x, int64_t M, int64_t K, const at::Tensor& w, const at::Tensor& s, float* y) {
  const int64_t N = w.size(0);
  if (w.is_mkldnn()) {
    static const auto packed = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == K, "decode_layer: packed weights are oneDNN's bf16 [N, K]");
    std::vector<c10::IValue> stack{at::from_blob(const_cast<float*>(x), {M, K}, at::kFloat).to(at::kBFloat16), w, c10::IValue(),
                                   c10::IValue(std::string("none")), c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
    packed.callBoxed(&stack);
    at::from_blob(y, {M, N}, at::kFloat).copy_(stack[0].toTensor());
    return;
  }
  if (w.scalar_type() == at::kByte) {
    TORCH_CHECK(w.is_contiguous() && K % (2 * Q4_GROUP) == 0 && w.size(1) == K / Q4_GROUP * Q4_BYTES, "decode_layer: Q4 weights [N, K / 32 * 20], contiguous");
    return matmul_q4_into(x, M, K, w.data_ptr<uint8_t>(), y, N, false);
  }
  TORCH_CHECK(w.is_contiguous() && w.size(1) == K, "decode_layer: weights [N, K], contiguous");
  switch (w.scalar_type()) {
    case at::kChar: TORCH_CHECK(s.numel() == N, "decode_layer: int8 weights need one scale per row");
                    matmul_into(x, M, K, w.data_ptr<int8_t>(), f32(s, "scales"), y, N, false); break;
    case at::kBFloat16: matmul_into(x, M, K, w.data_ptr<at::BFloat16>(), (const float*)nullptr, y, N, false); break;
    case at::kFloat: matmul_into(x, M, K, w.data_ptr<float>(), (const float*)nullptr, y, N, false); break;
    default: TORCH_CHECK(false, "decode_layer: weights must be Q4 (uint8), int8, bf16 or fp32");
  }
}

template <typename T>
static void store_qkv(const float* qkvp, T* qp, T* kc, T* vc, const int64_t* slp, int64_t M, int64_t Q, int64_t KV) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = qkvp + m * (Q + 2 * KV);
    for (int64_t i = 0; i < Q; ++i) qp[m * Q + i] = static_cast<T>(row[i]);
    for (int64_t i = 0; i < KV; ++i) { kc[slp[m] * KV + i] = static_cast<T>(row[Q + i]); vc[slp[m] * KV + i] = static_cast<T>(row[Q + KV + i]); }
  }
}

static std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x_, const at::Tensor& residual, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
    const at::Tensor& bqkv, const at::Tensor& wqkv, const at::Tensor& sqkv, const at::Tensor& wo, const at::Tensor& so,
    const at::Tensor& wgu, const at::Tensor& sgu, const at::Tensor& wd, const at::Tensor& sd,
    const at::Tensor& cos, const at::Tensor& sin, int64_t nh, int64_t nkv, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const auto T = x_.scalar_type();
  const int64_t M = x_.size(0), H = x_.size(1), D = k_cache.size(3), Q = nh * D, KV = nkv * D, I = wgu.size(0) / 2;
  TORCH_CHECK(T == at::kFloat || T == at::kBFloat16, "decode_layer: fp32 or bf16 activations");
  TORCH_CHECK(wqkv.size(0) == Q + 2 * KV && wo.size(0) == H && wd.size(0) == H, "decode_layer: weight shapes");
  TORCH_CHECK(!bqkv.numel() || bqkv.numel() == Q + 2 * KV, "decode_layer: the qkv bias is empty or one per output");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == T && v_cache.scalar_type() == T &&
              k_cache.size(2) == nkv, "decode_layer: contiguous caches [blocks, block_size, kv_heads, D] in the activations' dtype");
  TORCH_CHECK(cos.size(0) == M && cos.size(1) == D / 2 && slots.scalar_type() == at::kLong && slots.numel() == M, "decode_layer: cos, sin, slots");
  auto opt = x_.options().dtype(at::kFloat);
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  at::Tensor res = residual.numel() ? residual.to(at::kFloat, false, true).contiguous() : at::empty_like(x);
  at::Tensor h = at::empty({M, H}, opt), qkv = at::empty({M, Q + 2 * KV}, opt), q = at::empty({M, nh, D}, x_.options());
  at::Tensor att = at::empty({M, nh, D}, x_.options()), gu = at::empty({M, 2 * I}, opt), act = at::empty({M, I}, opt), y = at::empty({M, H}, opt);
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous(), sl = slots.contiguous();
  float *rp = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *w1 = f32(ln1, "ln1"), *w2 = f32(ln2, "ln2");
  for (int64_t m = 0; m < M; ++m)      // the first layer has no residual yet: it starts as x
    add_rms_norm_row(residual.numel() ? rp + m * H : xp + m * H, residual.numel() ? xp + m * H : nullptr, rp + m * H, w1, hp + m * H, H, (float)eps);
  mm(hp, M, H, wqkv, sqkv, qkvp);
  if (bqkv.numel()) {      // before RoPE, as the module adds it
    const float* bp = f32(bqkv, "qkv bias");
    for (int64_t m = 0; m < M; ++m) for (int64_t i = 0; i < Q + 2 * KV; ++i) qkvp[m * (Q + 2 * KV) + i] += bp[i];
  }
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>(); const int64_t* slp = sl.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)      // q's heads, then k's: adjacent in the row
    for (int64_t hd = 0; hd < nh + nkv; ++hd) {
      float* p = qkvp + m * (Q + 2 * KV) + hd * D;
      rope_head(p, p, D / 2, cp + m * (D / 2), sp + m * (D / 2));
    }
  if (T == at::kFloat) store_qkv(qkvp, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slp, M, Q, KV);
  else store_qkv(qkvp, q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), slp, M, Q, KV);
  static auto decode = c10::Dispatcher::singleton().findSchemaOrThrow("llm_engine::paged_decode", "")
      .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, double)>();
  decode.call(att, q, k_cache, v_cache, block_tables, context_lens, scale, 0, 0.0);
  const at::Tensor attf = att.to(at::kFloat).contiguous();
  mm(attf.data_ptr<float>(), M, Q, wo, so, y.data_ptr<float>());
  for (int64_t m = 0; m < M; ++m) add_rms_norm_row(rp + m * H, y.data_ptr<float>() + m * H, rp + m * H, w2, hp + m * H, H, (float)eps);
  float *gp = gu.data_ptr<float>(), *ap = act.data_ptr<float>();
  mm(hp, M, H, wgu, sgu, gp);
  for (int64_t m = 0; m < M; ++m) silu_mul_row(gp + m * 2 * I, ap + m * I, I);
  mm(ap, M, I, wd, sd, y.data_ptr<float>());
  return {y.to(T), res.to(T)};
}

// every layer of a decode step in one call: the layers' tensors come as lists, one entry per layer (30 calls from
// Python cost some 10 us each in argument handling alone)
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const at::Tensor& residual, at::TensorList ln1, at::TensorList ln2, double eps,
    at::TensorList bqkv, at::TensorList wqkv, at::TensorList sqkv, at::TensorList wo, at::TensorList so,
    at::TensorList wgu, at::TensorList sgu, at::TensorList wd, at::TensorList sd, const at::Tensor& cos, const at::Tensor& sin,
    int64_t nh, int64_t nkv, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const size_t L = ln1.size();
  for (auto n : {ln2.size(), bqkv.size(), wqkv.size(), sqkv.size(), wo.size(), so.size(), wgu.size(), sgu.size(), wd.size(), sd.size(), k_caches.size(), v_caches.size()})
    TORCH_CHECK(n == L, "decode_layers: one entry per layer in every list");
  at::Tensor h = x, r = residual;
  for (size_t i = 0; i < L; ++i)
    std::tie(h, r) = decode_layer(h, r, ln1[i], ln2[i], eps, bqkv[i], wqkv[i], sqkv[i], wo[i], so[i], wgu[i], sgu[i], wd[i], sd[i], cos, sin,
                                  nh, nkv, k_caches[i], v_caches[i], slots, block_tables, context_lens, scale);
  return {h, r};
}

// ---- the small operations between the matmuls, for fp32 or bf16 activations

// (normed, new residual): residual + x (rounded to T, as PyTorch's add would be), then RMS-normalised by w
std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x_, const at::Tensor& residual, const at::Tensor& w_, double eps) {
  TORCH_CHECK(x_.dim() == 2 && w_.numel() == x_.size(1), "add_rms_norm: x [M, H], w [H]");
  TORCH_CHECK(!residual.numel() || (residual.sizes() == x_.sizes() && residual.scalar_type() == x_.scalar_type()), "add_rms_norm: residual like x");
  const at::Tensor x = x_.contiguous(), w = w_.to(at::kFloat).contiguous();
  at::Tensor res = residual.numel() ? at::empty_like(x) : x, out = at::empty_like(x);
  const at::Tensor r0 = residual.numel() ? residual.contiguous() : residual;
  const int64_t M = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>(); scalar_t *rp = res.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    const float* wp = w.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      add_rms_norm_row(xp + m * H, r0.numel() ? r0.data_ptr<scalar_t>() + m * H : nullptr, rp + m * H, wp, op + m * H, H, (float)eps);
  });
  return {out, res};
}

// RoPE on the q and k parts of each row of qkv [M, (nh + 2 nkv) D] (rotate-half, by cos / sin [M, D/2]), K and V
// written to their cache slots; returns q [M, nh, D]. qkv is left as it was.
at::Tensor rope_store(const at::Tensor& qkv_, const at::Tensor& cos_, const at::Tensor& sin_, int64_t nh, int64_t nkv,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots_) {
  const at::Tensor qkv = qkv_.contiguous(), c = cos_.to(at::kFloat).contiguous(), s = sin_.to(at::kFloat).contiguous(), sl = slots_.contiguous();
  const int64_t M = qkv.size(0), D = k_cache.size(3), Q = nh * D, KV = nkv * D, h2 = D / 2;
  TORCH_CHECK(qkv.size(1) == Q + 2 * KV && k_cache.size(2) == nkv && k_cache.is_contiguous() && v_cache.is_contiguous(), "rope_store: shapes");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() && sl.numel() == M, "rope_store: dtypes, slots");
  at::Tensor q = at::empty({M, nh, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_store", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>(); scalar_t *qp = q.data_ptr<scalar_t>(), *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    const int64_t* slp = sl.data_ptr<int64_t>();
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {     // rows write distinct slots
      for (int64_t m = m0; m < m1; ++m) {
        const scalar_t* row = src + m * (Q + 2 * KV); const float *cm = c.data_ptr<float>() + m * h2, *sm = s.data_ptr<float>() + m * h2;
        for (int64_t h = 0; h < nh + nkv; ++h)        // q's heads, then k's: adjacent in the row
          rope_head(row + h * D, h < nh ? qp + m * Q + h * D : kc + slp[m] * KV + (h - nh) * D, h2, cm, sm);
        std::copy(row + Q + KV, row + Q + 2 * KV, vc + slp[m] * KV);
      }
    });
  });
  return q;
}

// silu(gate) * up of gu [M, 2I] (gate first, as the fused gate_up projection writes them)
at::Tensor silu_mul(const at::Tensor& gu_) {
  const at::Tensor gu = gu_.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* g = gu.data_ptr<scalar_t>(); scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) { for (int64_t m = m0; m < m1; ++m) silu_mul_row(g + m * 2 * I, o + m * I, I); });
  });
  return out;
}

// ---- int8 activations for large batches (w8a8, notebook 05b) ----
// Row m of x, divided by the smoothing factors s, becomes int8 q with one scale a[m] = max|x/s| / qmax (qmax 127, or
// 63 where the CPU has no VNNI: its 8-bit multiply-adds sum pairs of u8 x s8 products in 16 bits, which saturate
// unless the unsigned side stays below 128). A row with
// a non-finite value gets a NaN scale and zeros, so the NaN reaches the output as it would in fp32 (the sum
// carries it: -ffast-math may drop a NaN from the max).
template <typename T, typename S, typename Q>
static void quantize_row(const T* x, const S* s, int64_t K, Q* q, float* a, int zero, float qmax) {
  float amax = 0.f, sum = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::fabs(static_cast<float>(x[k]) / static_cast<float>(s[k])); amax = std::max(amax, v); sum += v;
  }
  if (nonfinite(sum)) { std::fill(q, q + K, static_cast<Q>(zero)); *a = quiet_nan(); return; }
  const float scale = std::max(amax, 1e-30f) / qmax;
  for (int64_t k = 0; k < K; ++k) {
    const float v = static_cast<float>(x[k]) / static_cast<float>(s[k]) / scale;
    q[k] = static_cast<Q>(static_cast<int>(std::max(-qmax, std::min(qmax, std::nearbyint(v)))) + zero);
  }
  *a = scale;
}

// the smoothing factors and scales come as the model holds them: fp32, or bf16 in a model cast to bf16
#define DISPATCH_SCALES(t, ...) \
  if ((t).scalar_type() == at::kFloat) { using S = float; __VA_ARGS__(); } \
  else { TORCH_CHECK((t).scalar_type() == at::kBFloat16, "scales: fp32 or bf16"); using S = at::BFloat16; __VA_ARGS__(); }

// q: int8, or with `zero_point` 128 (or 64, for qmax 63) uint8 (q + zero_point), the form oneDNN's u8 x s8 matmul takes
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_, const at::Tensor& s_, int64_t zero_point, int64_t qmax) {
  const at::Tensor x = x_.contiguous(), s = s_.contiguous();
  TORCH_CHECK(x.dim() == 2 && s.numel() == x.size(1), "quantize_rows: x [M, K] and one smoothing factor per column");
  TORCH_CHECK(qmax >= 1 && qmax <= 127 && (zero_point == 0 || (zero_point > qmax && zero_point + qmax <= 255)),
              "quantize_rows: qmax in 1..127, zero_point 0 (int8) or a uint8 offset that keeps q + zero_point in 0..255");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(zero_point ? at::kByte : at::kChar)), a = at::empty({M, 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_rows", [&] {
    DISPATCH_SCALES(s, [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>(); const S* sp = s.data_ptr<S>(); float* ap = a.data_ptr<float>();
      at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          if (zero_point) quantize_row(xp + m * K, sp, K, q.data_ptr<uint8_t>() + m * K, ap + m, (int)zero_point, (float)qmax);
          else quantize_row(xp + m * K, sp, K, q.data_ptr<int8_t>() + m * K, ap + m, 0, (float)qmax);
        }
      });
    });
  });
  return {q, a};
}

// y [M, N] = acc times the rows' scales a [M] and the columns' w [N] (w empty: 1); acc is the int32 product of
// quantized rows and weights, or an fp32 one that already carries the columns' scales
at::Tensor dequantize_rows(const at::Tensor& acc_, const at::Tensor& a_, const at::Tensor& w_, at::ScalarType dtype) {
  const at::Tensor acc = acc_.contiguous(), a = a_.contiguous(), w = w_.contiguous();
  TORCH_CHECK((acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat) && acc.dim() == 2 && a.scalar_type() == at::kFloat &&
              a.numel() == acc.size(0) && (w.numel() == acc.size(1) || w.numel() == 0), "dequantize_rows: int32 or fp32 acc [M, N], fp32 a [M], w [N] or empty");
  const int64_t M = acc.size(0), N = acc.size(1);
  at::Tensor y = at::empty({M, N}, acc.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "dequantize_rows", [&] {
    const float* ap = a.data_ptr<float>(); scalar_t* yp = y.data_ptr<scalar_t>();
    auto rows = [&](auto* cp, auto* wp) {
      at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          const float am = ap[m]; const auto* c = cp + m * N; scalar_t* o = yp + m * N;
          if (wp) for (int64_t n = 0; n < N; ++n) o[n] = static_cast<scalar_t>(static_cast<float>(c[n]) * am * static_cast<float>(wp[n]));
          else for (int64_t n = 0; n < N; ++n) o[n] = static_cast<scalar_t>(static_cast<float>(c[n]) * am);
        }
      });
    };
    if (w.numel() == 0) { if (acc.scalar_type() == at::kInt) rows(acc.data_ptr<int32_t>(), (const float*)nullptr); else rows(acc.data_ptr<float>(), (const float*)nullptr); }
    else DISPATCH_SCALES(w, [&] {
      if (acc.scalar_type() == at::kInt) rows(acc.data_ptr<int32_t>(), w.data_ptr<S>()); else rows(acc.data_ptr<float>(), w.data_ptr<S>());
    });
  });
  return y;
}

// the index of each row's largest value, the first where it repeats (torch.argmax's answer for finite rows; the
// sampler calls it only when every logit is finite); torch's own reduction runs on one thread, 1.3 ms at [32, 49152]
at::Tensor argmax_rows(const at::Tensor& x_) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: fp32 [M, N], N > 0");
  const int64_t M = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>(); int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = xp + m * N; float best = r[0];
      for (int64_t n = 1; n < N; ++n) best = std::max(best, r[n]);      // vectorizes; the index is found after
      int64_t i = 0; while (r[i] != best) ++i;
      op[m] = i;
    }
  });
  return out;
}

bool int8_linear_vectorized() { return has_vector_path(); }
std::string step_kernels_isa() { return kernel_isa(); }

TORCH_LIBRARY_FRAGMENT(llm_engine, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, bool generic=False) -> Tensor");
  m.def("int8_linear_vectorized() -> bool", &int8_linear_vectorized);
  m.def("step_kernels_isa() -> str", &step_kernels_isa);
  m.def("q4_linear(Tensor x, Tensor w, bool generic=False) -> Tensor");
  m.def("q4_dequantize(Tensor w, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, int nh, int nkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("quantize_rows(Tensor x, Tensor smooth, int zero_point=0, int qmax=127) -> (Tensor, Tensor)");
  m.def("dequantize_rows(Tensor acc, Tensor row_scales, Tensor col_scales, ScalarType dtype) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor residual, Tensor[] ln1, Tensor[] ln2, float eps, Tensor[] bqkv, Tensor[] wqkv, Tensor[] sqkv, "
        "Tensor[] wo, Tensor[] so, Tensor[] wgu, Tensor[] sgu, Tensor[] wd, Tensor[] sd, Tensor cos, Tensor sin, int nh, int nkv, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor block_tables, Tensor context_lens, float scale) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(llm_engine, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("q4_linear", q4_linear);
  m.impl("q4_dequantize", q4_dequantize);
  m.impl("decode_layers", decode_layers);
  m.impl("add_rms_norm", add_rms_norm_op);
  m.impl("rope_store", rope_store);
  m.impl("silu_mul", silu_mul);
  m.impl("argmax_rows", argmax_rows);
  m.impl("quantize_rows", quantize_rows);
  m.impl("dequantize_rows", dequantize_rows);
}
// a big bf16 model's layers come as oneDNN's packed weights (mm above): the dispatcher then picks the MkldnnCPU key
TORCH_LIBRARY_IMPL(llm_engine, MkldnnCPU, m) { m.impl("decode_layers", decode_layers); }
