// The decode step's own CPU kernels (loaded by llm_engine.precision; compiled on first use, cached):
// - int8_linear: weight-only int8 matmul for the few rows of a decode step, y[m, n] = scale[n] * sum_k x[m, k] * w[n, k].
//   A decode step is bound by reading weights, so each int8 weight is read once, widened to fp32 in registers and
//   used by every row of x; the arithmetic is fp32. Under AVX2, bf16 and int8 weights take it up to 128 rows
//   (pair_avx2: two weight rows at a time), where it beats MKL on weights widened per call.
// - add_rms_norm, rope_store, silu_mul: the small operations between a layer's matmuls, one call each instead of
//   five to ten PyTorch calls, for fp32 or bf16 activations (arithmetic in fp32, results rounded to the activations' dtype).
// - q4_linear: the same for 4-bit weights in GGUF's Q4_1 blocks (a scale and a minimum per 32 weights), laid out in
//   groups of 16 blocks; the activations are rounded to 16 bits per block of 32 and the products are integer multiply-adds.
// - decode_layers: every decoder layer of a decode step for a few rows in one call (decode_layer: one of them), weights
//   Q4, int8 (with scales), bf16 or fp32; q/k/v biases where the family has them (Qwen2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cstdlib>
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

// Output channels [0, N) over the threads, each thread one contiguous range (one sequential stream of weights), taken in
// chunks of `chunk` rows; a thread whose range is done takes chunks left in the others' ranges. A static split left
// one of two threads spinning at the end of each matmul: TinyLlama-1.1B's q4 step on the EPYC, the worker spent 24% of
// its samples waiting in libgomp while the main thread, which does the serial work between the matmuls, finished last
template <typename F>
static void balanced_for(int64_t N, int64_t chunk, const F& f) {
  const int T = (int)std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, N / chunk));
  if (T <= 1) { f(0, N); return; }
  std::vector<std::atomic<int64_t>> next(T);
  std::vector<int64_t> end(T);
  const int64_t C = (N + chunk - 1) / chunk;      // ranges start on a chunk's edge (the pair kernel takes rows two by two)
  for (int t = 0; t < T; ++t) { next[t] = C * t / T * chunk; end[t] = std::min(N, C * (t + 1) / T * chunk); }
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t own = t0; own < t1; ++own)
      for (int64_t i = 0; i < T; ++i) {          // its own range first, then the next ones round
        const int64_t t = (own + i) % T;
        for (int64_t n0; (n0 = next[t].fetch_add(chunk)) < end[t];) f(n0, std::min(end[t], n0 + chunk));
      }
  });
}

constexpr int RB = 4;   // rows of x per pass: U * RB accumulators stay in registers

// M rows in as few groups of at most `most` as can be, of sizes as equal as can be (32 rows by 5: 5, 5, 5, 5, 4, 4, 4,
// not six 5s and a 2): f(first row, rows)
static inline int64_t group_count(int64_t M, int64_t most) { return (M + most - 1) / most; }
template <typename F>
static void row_groups(int64_t M, int64_t most, const F& f) {
  const int64_t G = group_count(M, most), base = M / G, extra = M % G;
  for (int64_t g = 0, m = 0; g < G; ++g) { const int64_t r = base + (g < extra); f(m, r); m += r; }
}

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
// The hardware prefetcher alone kept a one-row step well below the memory's bandwidth on the Intel Xeon: each weight
// row is a few KB, and the widening arithmetic between loads left too few misses in flight. Asking for the line
// `weight_prefetch` bytes ahead (the next row's, near a row's end) measured there, TinyLlama-1.1B's 88 int8 matmuls at
// one row streamed from memory: 15.7 -> 18.6 GB/s on AVX-512, 11.5 -> 17.5 GB/s under AVX2 (the stream alone: 25 and
// 23); the Q4 kernels' 88 matmuls 48.4 -> 35.9 ms on AVX-512, 92.0 -> 64.4 under AVX2. On the AMD EPYC (Zen 4) the same
// hints cost time: one user, TinyLlama-1.1B's shape, requests alternated in one process with the hints on and off,
// int8 1.21x and bf16 1.03x slower on AVX-512, bf16 1.10x under AVX2, q4 within 2% either way (SmolLM2 bf16 1.035x
// slower). AMD's own prefetchers follow these streams, and the hints only take fill buffers: none on AMD by default.
// LLM_ENGINE_WEIGHT_PREFETCH=<bytes> sets the distance (0: no hints) on any CPU, read once when the kernels load
static int64_t default_weight_prefetch() {
  if (const char* e = std::getenv("LLM_ENGINE_WEIGHT_PREFETCH")) return std::max<int64_t>(0, std::atoll(e));
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? 0 : 2048;
}
static const int64_t weight_prefetch = default_weight_prefetch();
// one prefetch per cache line of the n weights at w (one for less than a line)
template <int n, typename W> static inline void prefetch_ahead(const W* w) {
  constexpr int lines = n * (int)sizeof(W) / 64 > 0 ? n * (int)sizeof(W) / 64 : 1;
  if (weight_prefetch) for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)w + 64 * l + weight_prefetch, _MM_HINT_T0);
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

#if defined(__AVX512F__)
// int8 weights by AVX512_VNNI's 16-bit dot product where the CPU has it: x rounded to int16 once per matmul, with one
// scale per row (a relative error of at most 2^-16 of the row's largest value), each 32 weights widened to int16 in one
// instruction and multiplied with 32 values of x, pairs summed into 16 int32 lanes, in one more. The fp32 kernel above
// made three instructions (widen to int32, convert, multiply-add) of every 16 weights and read them at 24 GB/s on the
// Zen 4, where bf16 weights streamed at 34 (TinyLlama-1.1B's shape, one user). A lane takes two products of at most
// 127 * 32767 per instruction, and U chains share K: K up to 32768 stays inside int32
static bool int16_dot_product() {     // the widening to int16 is AVX512BW's (every CPU with AVX512_VNNI has it; asked all the same)
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return yes;
}
constexpr int64_t VNNI_MAX_K = 32768;
template <int R>
__attribute__((target("avx512vnni,avx512bw")))
static void row_vnni(const int16_t* x, const float* xs, int64_t K, const int8_t* wr, float s, float* y, int64_t N) {
  __m512i acc[U][R];
  for (int u = 0; u < U; ++u) for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U)
    for (int u = 0; u < U; ++u) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wr + k + 32 * u)));
      for (int r = 0; r < R; ++r) acc[u][r] = _mm512_dpwssd_epi32(acc[u][r], wv, _mm512_loadu_si512(x + r * K + k + 32 * u));
    }
  for (; k < K; k += 32) {
    const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wr + k)));
    for (int r = 0; r < R; ++r) acc[0][r] = _mm512_dpwssd_epi32(acc[0][r], wv, _mm512_loadu_si512(x + r * K + k));
  }
  for (int r = 0; r < R; ++r) {     // the lanes summed exactly in int64 (in int32 they could pass 2^31), then scaled once
    __m512i t = _mm512_setzero_si512();
    for (int u = 0; u < U; ++u)
      t = _mm512_add_epi64(_mm512_add_epi64(t, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[u][r]))),
                           _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[u][r], 1)));
    y[r * N] = (float)((double)_mm512_reduce_add_epi64(t) * s * xs[r]);
  }
}

// x [M, K] fp32 -> int16 with one scale per row (max |x| / 32767; 0 rows keep scale 0), rows split between the threads,
// into this thread's buffers (grown once, as xperm below): the rows (q) and their scales
struct Int16Rows { const int16_t* q; const float* scales; };
static Int16Rows round_rows_int16(const float* x, int64_t M, int64_t K) {
  thread_local std::vector<int16_t> xq; thread_local std::vector<float> xs;
  if ((int64_t)xq.size() < M * K) xq.resize(M * K);
  if ((int64_t)xs.size() < M) xs.resize(M);
  int16_t* q = xq.data(); float* scales = xs.data();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K; float a = 0.f;
      for (int64_t k = 0; k < K; ++k) a = std::max(a, std::fabs(xr[k]));
      const float sc = a / 32767.f, inv = a > 0.f ? 32767.f / a : 0.f;
      for (int64_t k = 0; k < K; ++k) q[m * K + k] = (int16_t)std::nearbyint(xr[k] * inv);
      scales[m] = sc;
    }
  });
  return {q, scales};
}

static void block_vnni(const int16_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* w, const float* sc, float* y,
                       int64_t N, int64_t n0, int64_t n1) {
  static void (*const rows[RB + 1])(const int16_t*, const float*, int64_t, const int8_t*, float, float*, int64_t) =
      {nullptr, row_vnni<1>, row_vnni<2>, row_vnni<3>, row_vnni<4>};
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; m += RB)
      rows[std::min<int64_t>(RB, M - m)](xq + m * K, xs + m, K, w + n * K, sc ? sc[n] : 1.f, y + m * N + n, N);
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
// widening a row with a shift costs one uop on the FMA ports for every FMA-sized load, and re-reading the rows
// of x for every weight row leaves one load per FMA. Two weight rows at a time (each x load serves both) widened by
// interleaving with zero (vpunpcklwd / vpunpckhwd: port 5 only) take both costs off the FMA ports. The interleave
// yields weights 0-3 and 8-11 of 16 (then 4-7, 12-15), so x is copied once per call into that order
// (perm_rows). bf16 interleaved under zero is its fp32 value; int8, sign-extended to 16 bits first, becomes
// its value times 2^16 as an int32, exact in fp32 (PairWeights::unit folds the 2^16 into the row's scale).
template <typename W> struct PairWeights;
template <> struct PairWeights<at::BFloat16> {
  static constexpr float unit = 1.f;
  static constexpr int rows = 5;        // rows of x a pass: 10 accumulators, two weights, one x, the zero (at 6 it spilled)
  static __m256i load(const at::BFloat16* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static __m256 half(__m256i v, int h) { const __m256i z = _mm256_setzero_si256(); return _mm256_castsi256_ps(h ? _mm256_unpackhi_epi16(z, v) : _mm256_unpacklo_epi16(z, v)); }
};
template <> struct PairWeights<int8_t> {
  static constexpr float unit = 1.f / 65536.f;
  static constexpr int rows = 4;        // its two rows' 16-bit words stay in registers across both halves: at 5 rows it spilled
  static __m256i load(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
  static __m256 half(__m256i v, int h) { const __m256i z = _mm256_setzero_si256(); return _mm256_cvtepi32_ps(h ? _mm256_unpackhi_epi16(z, v) : _mm256_unpacklo_epi16(z, v)); }
};
constexpr int PAIR_MIN_ROWS = 4;            // rows from which the pair kernel runs (below: row_avx2, bandwidth-bound)
constexpr int64_t PAIR_N_BLOCK = 64;        // weight rows kept in L2 while every group of x rows passes over them
constexpr int64_t PAIR_K_BLOCK = 1024;      // and columns: five rows of x, 20 KB, stay in L1
static void perm_rows(const float* x, int64_t M, int64_t K, float* xp) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16) {
      const float* s = x + m * K + k; float* d = xp + m * K + k;
      for (int i = 0; i < 4; ++i) { d[i] = s[i]; d[4 + i] = s[8 + i]; d[8 + i] = s[4 + i]; d[12 + i] = s[12 + i]; }
    }
}

template <typename W, int P, int R>     // P weight rows (1 or 2) by R rows of x (1-5): P * R accumulators, over k0 <= k < k1
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
        __m256 xv = _mm256_loadu_ps(xp + r * K + k + 8 * half);
        // one load of x for both weight rows: left to itself the compiler folded it into each FMA, two loads per
        // FMA pair, and the loads bound the loop (a 32-row step's matmuls were 1.4x slower)
        __asm__("" : "+x"(xv));
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
  static const F two[6] = {nullptr, pair_avx2<W, 2, 1>, pair_avx2<W, 2, 2>, pair_avx2<W, 2, 3>, pair_avx2<W, 2, 4>, pair_avx2<W, 2, 5>};
  static const F one[6] = {nullptr, pair_avx2<W, 1, 1>, pair_avx2<W, 1, 2>, pair_avx2<W, 1, 3>, pair_avx2<W, 1, 4>, pair_avx2<W, 1, 5>};
  constexpr int64_t RW = PairWeights<W>::rows;
  static_assert(RW <= 5, "two[] and one[] go to 5 rows");
  for (int64_t b = n0; b < n1; b += PAIR_N_BLOCK) {
    const int64_t e = std::min(n1, b + PAIR_N_BLOCK);
    for (int64_t k0 = 0; k0 < K; k0 += PAIR_K_BLOCK) {
      const int64_t k1 = std::min(K, k0 + PAIR_K_BLOCK);
      row_groups(M, RW, [&](int64_t m, int64_t r) {
        int64_t n = b;
        for (; n + 2 <= e; n += 2) two[r](xp + m * K, K, w + n * K, sc ? sc + n : nullptr, y + m * N + n, N, k0, k1);
        if (n < e) one[r](xp + m * K, K, w + n * K, sc ? sc + n : nullptr, y + m * N + n, N, k0, k1);
      });
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
      balanced_for(N, 32, [&](int64_t n0, int64_t n1) { block_pairs_avx2(xq, M, K, wp, sp, yp, N, n0, n1); });
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, int8_t>) {
    if (vec && int16_dot_product() && K % 32 == 0 && K <= VNNI_MAX_K) {
      const Int16Rows xr = round_rows_int16(xp, M, K);
      balanced_for(N, 32, [&](int64_t n0, int64_t n1) { block_vnni(xr.q, xr.scales, M, K, wp, sp, yp, N, n0, n1); });
      return;
    }
  }
#endif
  balanced_for(N, 32, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
    if (vec) { block_avx512(xp, M, K, wp, sp, yp, N, n0, n1); return; }
#elif defined(LLM_AVX2)
    if (vec) { block_avx2(xp, M, K, wp, sp, yp, N, n0, n1); return; }
#endif
    block_generic(xp, M, K, wp, sp, yp, N, n0, n1);
  });
}

// ---- weights in panels, where the CPU has no bf16 arithmetic (AVX2): the weight [N, K] held as [N / 16, K, 16], for
// each k the weights of 16 output rows side by side; bf16, or int8 with one scale per output row. The kernels above
// take the dot product of a weight row with rows of x: each FMA needs a vector of x loaded and a widened weight, and
// they ran at half of the FMA peak. Here R rows of x meet a panel as outer products: for each k, one load of 16 weights
// widened into two fp32 vectors, and R values of x broadcast, 2R FMAs whose accumulators hold the R x 16 outputs all
// along k (int8's scales multiply them once at the end). Standalone on the EPYC (Zen 3), one core, bf16 weights cold:
// 79 GFLOP/s at 32 rows (the pair kernel: 44-52), 92 at 512 (MKL's fp32 matmul on the weight widened per call is no
// better there, so panels take every batch), ~11-12 GB/s at one row, as the row kernel. The layout is written at load
// (pack_panels) and read by every reader of the weight (panel_rows: a tied table's lookups, the dequantized weight);
// one copy of the weights.
constexpr int PANEL = 16;
// where weight (r, k) of a panel sits among its K * 16 (K even). bf16: two k's at a time, each row's pair adjacent
// ([K / 2][16][2]): the pairs AVX512_BF16's dot product multiplies, and under AVX2 one k's 8 rows come out of a dword
// per row, its low word shifted up (k even) or its high word masked (k odd). int8: the same pairs in the AVX-512 build,
// which AVX512_VNNI's 16-bit dot product multiplies (without VNNI a pair is widened to two int16, then the low one
// sign-extended or the high one shifted down); k by k in the AVX2 build, the 16 rows side by side, sign-extended 8 at
// a time (pairs took 1.5x as long there at one row, on weights in cache: a widening and two shifts more a pair)
#if defined(__AVX512F__)
constexpr bool INT8_PAIRS = true;
#else
constexpr bool INT8_PAIRS = false;
#endif
template <typename W> static inline int64_t panel_at(int64_t r, int64_t k) {
  return std::is_same_v<W, int8_t> && !INT8_PAIRS ? k * PANEL + r : (k >> 1) * 2 * PANEL + 2 * r + (k & 1);
}
constexpr int64_t PANEL_BLOCK = 4;      // panels kept in L2 while every group of rows passes over them
static int64_t out_rows(const at::Tensor& w) { return w.dim() == 3 ? w.size(0) * PANEL : w.size(0); }

template <typename W>
static void panels_generic(const float* x, int64_t M, int64_t K, const W* w, const float* sc, float* y, int64_t N, int64_t p0, int64_t p1) {
  float acc[PANEL];
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m = 0; m < M; ++m) {
      const W* pw = w + p * K * PANEL;
      for (int r = 0; r < PANEL; ++r) acc[r] = 0.f;
      for (int64_t k = 0; k < K; ++k) for (int r = 0; r < PANEL; ++r) acc[r] += x[m * K + k] * static_cast<float>(pw[panel_at<W>(r, k)]);
      for (int r = 0; r < PANEL; ++r) y[m * N + p * PANEL + r] = acc[r] * (sc ? sc[p * PANEL + r] : 1.f);
    }
}

#if defined(__AVX512F__) || defined(LLM_AVX2)
// k's 16 weights of panel pw as two fp32 vectors: rows 0-7, rows 8-15
static inline void panel_widen(const at::BFloat16* pw, int64_t k, __m256& w0, __m256& w1) {
  const __m256i* p = (const __m256i*)(pw + (k & ~int64_t(1)) * PANEL);
  const __m256i v0 = _mm256_loadu_si256(p), v1 = _mm256_loadu_si256(p + 1);
  if (k & 1) { const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
               w0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi)); w1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi)); }
  else { w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)); w1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)); }
}
static inline void panel_widen(const int8_t* pw, int64_t k, __m256& w0, __m256& w1) {
  if constexpr (!INT8_PAIRS) {
    const int8_t* p = pw + k * PANEL;
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
    return;
  }
  const int8_t* p = pw + (k & ~int64_t(1)) * PANEL;
  const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)), v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
  if (k & 1) { w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v0, 16)); w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v1, 16)); }
  else { w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v0, 16), 16)); w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v1, 16), 16)); }
}
// R rows of x (1-6) by one panel: 2 R U accumulators, U chains over k where R is too small to hide the FMA's latency;
// with at most 3 rows the step is bound by reading weights and asks for them ahead (weight_prefetch, above)
template <typename W, int R, int U>
static void panel_avx2(const float* x, int64_t K, const W* pw, const float* sc, float* y, int64_t N, const char* pf, int64_t pfn) {
  __m256 acc[U][R][2];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
  // the widened weights of k, multiplied into chain u (without the unroll pragmas GCC kept the accumulators on the
  // stack, stored every iteration)
#define LLM_PANEL_K(k, u) { \
    __m256 w0, w1; panel_widen(pw, k, w0, w1); \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) { \
      const __m256 xb = _mm256_broadcast_ss(x + r * K + (k)); \
      acc[u][r][0] = _mm256_fmadd_ps(w0, xb, acc[u][r][0]); \
      acc[u][r][1] = _mm256_fmadd_ps(w1, xb, acc[u][r][1]); } }
  constexpr int lines = std::max<int>(1, U * PANEL * (int)sizeof(W) / 64);
  int64_t k = 0;
  const int64_t every = std::max<int64_t>(1, K / U / std::max<int64_t>(1, pfn));   // the pfn lines at pf, spread over the pass
  for (int64_t wait = every; k + U <= K; k += U) {
    if constexpr (R <= 3) if (weight_prefetch) for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)(pw + PANEL * k) + 64 * l + weight_prefetch, _MM_HINT_T0);
    if constexpr (R > 3) if (pfn && --wait == 0) { _mm_prefetch(pf, _MM_HINT_T1); pf += 64; --pfn; wait = every; }
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) LLM_PANEL_K(k + u, u)
  }
  for (; k < K; ++k) LLM_PANEL_K(k, 0)
#undef LLM_PANEL_K
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) { acc[0][r][0] = _mm256_add_ps(acc[0][r][0], acc[u][r][0]); acc[0][r][1] = _mm256_add_ps(acc[0][r][1], acc[u][r][1]); }
    if (sc) { acc[0][r][0] = _mm256_mul_ps(acc[0][r][0], _mm256_loadu_ps(sc)); acc[0][r][1] = _mm256_mul_ps(acc[0][r][1], _mm256_loadu_ps(sc + 8)); }
    _mm256_storeu_ps(y + r * N, acc[0][r][0]);
    _mm256_storeu_ps(y + r * N + 8, acc[0][r][1]);
  }
}

template <typename W>
static void panels_avx2(const float* x, int64_t M, int64_t K, const W* w, const float* sc, float* y, int64_t N, int64_t p0, int64_t p1) {
  using F = void (*)(const float*, int64_t, const W*, const float*, float*, int64_t, const char*, int64_t);
  static const F f[7] = {nullptr, panel_avx2<W, 1, 4>, panel_avx2<W, 2, 2>, panel_avx2<W, 3, 2>, panel_avx2<W, 4, 1>, panel_avx2<W, 5, 1>, panel_avx2<W, 6, 1>};
  const int64_t P = N / PANEL, lines = K * PANEL * (int64_t)sizeof(W) / 64;    // a panel's cache lines
  for (int64_t b = p0; b < p1; b += PANEL_BLOCK) {
    const int64_t e = std::min(p1, b + PANEL_BLOCK), G = group_count(M, 6);
    int64_t g = 0;      // the group row_groups is at
    row_groups(M, 6, [&](int64_t m, int64_t r) {     // at most 6 rows: 12 accumulators
      for (int64_t p = b; p < e; ++p) {
        // the panel as far ahead as these are long (most often this thread's next ones): group g of the G asks for
        // its share of it into L2, so that the first group there does not wait on memory (it did: a quarter of the
        // 6-row kernel's samples sat on its weight load, in perf). Groups of at most 3 rows stream their weights with
        // hints of their own (above). SmolLM2, 32 prompts x 64 tokens, AVX2 forced on the Zen 4, alternated with
        // 58bc9c2's step (this and paged_decode.cpp's first read together): 452 / 435 / 408 -> 508 / 484 / 491 tok/s, the same tokens
        const int64_t ahead = p + (e - b), l0 = lines * g / G, l1 = lines * (g + 1) / G;
        const char* pf = ahead < P ? (const char*)(w + ahead * K * PANEL) + 64 * l0 : nullptr;
        f[r](x + m * K, K, w + p * K * PANEL, sc ? sc + p * PANEL : nullptr, y + m * N + p * PANEL, N, pf, pf ? l1 - l0 : 0);
      }
      ++g;
    });
  }
}
#endif

#if defined(__AVX512F__)
// Where the CPU has AVX512_BF16 (asked at run time; compiled for it whatever -march says): bf16 panels by its dot
// product, which multiplies a pair of k's for 16 rows in one instruction (32 products, where a fused multiply-add on
// widened weights makes 16), on x rounded to bf16 once per matmul, as oneDNN's bf16 matmul rounds it. Here R rows of x
// as k-pairs (1-3: a step bound by reading weights) by one panel: U chains over the pairs hide the instruction's
// latency, and each asks for its weights weight_prefetch bytes ahead
template <typename Y, int R, int U>
__attribute__((target("avx512bf16")))
static void panel_dp(const int32_t* x, int64_t K2, const at::BFloat16* pw, Y* y, int64_t N) {
  __m512 acc[U][R];
  // the unroll pragmas keep the accumulators in registers (as in panel_avx2); a macro, not a lambda, for the pair: a
  // lambda does not take the function's target, and the intrinsics would not inline
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  const int32_t* wp = (const int32_t*)pw;      // a k-pair of the panel: 16 dwords, one cache line
#define LLM_DP_PAIR(j, u) { \
    const __m512bh w = (__m512bh)_mm512_loadu_si512(wp + PANEL * (j)); \
    _Pragma("GCC unroll 3") for (int r = 0; r < R; ++r) \
      acc[u][r] = _mm512_dpbf16_ps(acc[u][r], w, (__m512bh)_mm512_set1_epi32(x[r * K2 + (j)])); }
  int64_t j = 0;
  for (; j + U <= K2; j += U) {
    if (weight_prefetch) for (int u = 0; u < U; ++u) _mm_prefetch((const char*)(wp + PANEL * (j + u)) + weight_prefetch, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) LLM_DP_PAIR(j + u, u)
  }
  for (; j < K2; ++j) LLM_DP_PAIR(j, 0)
#undef LLM_DP_PAIR
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) acc[0][r] = _mm512_add_ps(acc[0][r], acc[u][r]);
    if constexpr (std::is_same_v<Y, float>) _mm512_storeu_ps(y + r * N, acc[0][r]);
    else _mm256_storeu_si256((__m256i*)(y + r * N), (__m256i)_mm512_cvtneps_pbh(acc[0][r]));     // rounded to nearest even
  }
}

// R rows (1-6) by NP panels side by side (1-4, a block): NP R accumulators, each broadcast of x serving NP panels. One
// panel at a time, 12 rows, made as many broadcasts as products, and reached 270-340 GFLOP/s at 512 rows where
// oneDNN's bf16 matmul made 370-430. The next block is asked for into L2 over the pass, as panels_avx2 does
template <typename Y, int R, int NP>
__attribute__((target("avx512bf16")))
static void panel_dp_tile(const int32_t* x, int64_t K2, const at::BFloat16* pw, Y* y, int64_t N, const char* pf, int64_t pfn) {
  __m512 acc[NP][R];
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[q][r] = _mm512_setzero_ps();
  const int32_t* wp = (const int32_t*)pw;
  const int64_t ps = K2 * PANEL, every = std::max<int64_t>(1, K2 / std::max<int64_t>(1, pfn));     // dwords a panel
  for (int64_t j = 0, wait = every; j < K2; ++j) {
    if (pfn && --wait == 0) { _mm_prefetch(pf, _MM_HINT_T1); pf += 64; --pfn; wait = every; }
    __m512bh w[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) w[q] = (__m512bh)_mm512_loadu_si512(wp + q * ps + PANEL * j);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(x[r * K2 + j]);
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[q][r] = _mm512_dpbf16_ps(acc[q][r], w[q], b);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      if constexpr (std::is_same_v<Y, float>) _mm512_storeu_ps(y + r * N + q * PANEL, acc[q][r]);
      else _mm256_storeu_si256((__m256i*)(y + r * N + q * PANEL), (__m256i)_mm512_cvtneps_pbh(acc[q][r]));
    }
}

// the tiles' schedule (bf16's and int8's): blocks of up to PANEL_BLOCK panels of `bytes` each, every block passed by
// groups of at most `rows` rows of x, group g of the G asking for its share of the next block into L2 as it goes;
// tile(m, r, b, n, pf, pfn) runs rows m..m+r over panels b..b+n and asks for pfn lines at pf
template <typename T>
static void tile_blocks(int64_t M, int64_t N, int64_t p0, int64_t p1, int rows, int64_t bytes, const char* w, const T& tile) {
  const int64_t P = N / PANEL, lines = bytes / 64;
  for (int64_t b = p0; b < p1; b += PANEL_BLOCK) {
    const int64_t n = std::min(p1 - b, PANEL_BLOCK), G = group_count(M, rows), ahead = std::min(P - (b + n), PANEL_BLOCK);
    int64_t g = 0;
    row_groups(M, rows, [&](int64_t m, int64_t r) {
      const int64_t l0 = lines * ahead * g / G, l1 = lines * ahead * (g + 1) / G;
      const char* pf = ahead > 0 ? w + (b + n) * bytes + 64 * l0 : nullptr;
      tile(m, r, b, n, pf, pf ? l1 - l0 : 0);
      ++g;
    });
  }
}

constexpr int DP_FEW = 3, DP_ROWS = 6;     // up to DP_FEW rows one panel at a time (weights streamed), else tiles of DP_ROWS
template <typename Y>
static void panels_dp(const int32_t* x, int64_t M, int64_t K, const at::BFloat16* w, Y* y, int64_t N, int64_t p0, int64_t p1) {
  using F = void (*)(const int32_t*, int64_t, const at::BFloat16*, Y*, int64_t, const char*, int64_t);
  const int64_t K2 = K / 2;
  if (M <= DP_FEW) {
    using Few = void (*)(const int32_t*, int64_t, const at::BFloat16*, Y*, int64_t);
    static const Few f[DP_FEW + 1] = {nullptr, panel_dp<Y, 1, 4>, panel_dp<Y, 2, 2>, panel_dp<Y, 3, 2>};
    for (int64_t p = p0; p < p1; ++p) f[M](x, K2, w + p * K * PANEL, y + p * PANEL, N);
    return;
  }
#define LLM_DP_TILES(R) panel_dp_tile<Y, R, 1>, panel_dp_tile<Y, R, 2>, panel_dp_tile<Y, R, 3>, panel_dp_tile<Y, R, 4>
  static const F f[DP_ROWS][PANEL_BLOCK] = {{LLM_DP_TILES(1)}, {LLM_DP_TILES(2)}, {LLM_DP_TILES(3)}, {LLM_DP_TILES(4)}, {LLM_DP_TILES(5)}, {LLM_DP_TILES(6)}};
#undef LLM_DP_TILES
  tile_blocks(M, N, p0, p1, DP_ROWS, K * PANEL * 2, (const char*)w, [&](int64_t m, int64_t r, int64_t b, int64_t n, const char* pf, int64_t pfn) {
    f[r - 1][n - 1](x + m * K2, K2, w + b * K * PANEL, y + m * N + b * PANEL, N, pf, pfn);
  });
}
#endif

#if defined(__AVX512F__)
// int8 panels by AVX512_VNNI's 16-bit dot product (int16_dot_product()): 32 bytes a k-pair of a panel, widened to int16
// in one instruction, against x rounded to int16 once per matmul (a scale per row, as row_vnni above) and read as pairs;
// the same shapes as the bf16 kernels above (a few rows one panel at a time, else tiles of rows by a block of panels).
// Here a lane holds one output row's whole sum, two products of at most 127 * 32767 an instruction, so int32 would
// overflow past 258 pairs: every VNNI_WINDOW pairs the sums move into fp32. Each output is scaled once at the end
constexpr int64_t VNNI_WINDOW = 256;
constexpr int VNNI_ROWS = 4;      // rows of a tile
static inline __m512i pair16(const int8_t* pw, int64_t j) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(pw + 2 * PANEL * j))); }

template <int R, int U>
__attribute__((target("avx512vnni,avx512bw")))
static void panel_vnni(const int32_t* x, const float* xs, int64_t K2, const int8_t* pw, const float* ws, float* y, int64_t N) {
  __m512 f[R];
  __m512i acc[U][R];
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
#define LLM_VNNI_PAIR(j, u) { const __m512i w = pair16(pw, j); \
    _Pragma("GCC unroll 3") for (int r = 0; r < R; ++r) acc[u][r] = _mm512_dpwssd_epi32(acc[u][r], w, _mm512_set1_epi32(x[r * K2 + (j)])); }
  for (int64_t j0 = 0; j0 < K2; j0 += VNNI_WINDOW) {
    const int64_t j1 = std::min(K2, j0 + VNNI_WINDOW);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_si512();
    int64_t j = j0;
    for (; j + U <= j1; j += U) {
      if (weight_prefetch) for (int l = 0; l < (U + 1) / 2; ++l) _mm_prefetch((const char*)(pw + 2 * PANEL * j) + 64 * l + weight_prefetch, _MM_HINT_T0);     // 2 pairs a line
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) LLM_VNNI_PAIR(j + u, u)
    }
    for (; j < j1; ++j) LLM_VNNI_PAIR(j, 0)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) f[r] = _mm512_add_ps(f[r], _mm512_cvtepi32_ps(acc[u][r]));
  }
#undef LLM_VNNI_PAIR
  const __m512 s = _mm512_loadu_ps(ws);
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, _mm512_mul_ps(_mm512_mul_ps(f[r], s), _mm512_set1_ps(xs[r])));
}

// pairs j0..j1 (at most VNNI_WINDOW) of a tile into its fp32 sums f (first: set them): the int32 accumulators are this
// function's own, as in panel_dp_tile (with the window loop around them in one function GCC kept them on the stack,
// stored every pair: 240 GFLOP/s where the bf16 tiles made 450)
template <int R, int NP>
__attribute__((target("avx512vnni,avx512bw"), noinline))
static void vnni_window(const int32_t* x, int64_t K2, const int8_t* pw, int64_t j0, int64_t j1, float (*f)[R][PANEL], bool first,
                        const char*& pf, int64_t& pfn, int64_t every, int64_t& wait) {
  __m512i acc[NP][R];
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[q][r] = _mm512_setzero_si512();
  const int64_t ps = K2 * 2 * PANEL;      // bytes a panel
  for (int64_t j = j0; j < j1; ++j) {
    if (pfn && --wait == 0) { _mm_prefetch(pf, _MM_HINT_T1); pf += 64; --pfn; wait = every; }
    __m512i w[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) w[q] = pair16(pw + q * ps, j);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_set1_epi32(x[r * K2 + j]);
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[q][r] = _mm512_dpwssd_epi32(acc[q][r], w[q], b);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_cvtepi32_ps(acc[q][r]);
      _mm512_store_ps(f[q][r], first ? v : _mm512_add_ps(_mm512_load_ps(f[q][r]), v));
    }
}

template <int R, int NP>
__attribute__((target("avx512vnni,avx512bw")))
static void panel_vnni_tile(const int32_t* x, const float* xs, int64_t K2, const int8_t* pw, const float* ws, float* y, int64_t N,
                            const char* pf, int64_t pfn) {
  alignas(64) float f[NP][R][PANEL];      // the fp32 sums, in L1: with the int32 ones they would not fit the registers
  const int64_t every = std::max<int64_t>(1, K2 / std::max<int64_t>(1, pfn));
  int64_t wait = every;
  for (int64_t j0 = 0; j0 < K2; j0 += VNNI_WINDOW) vnni_window<R, NP>(x, K2, pw, j0, std::min(K2, j0 + VNNI_WINDOW), f, j0 == 0, pf, pfn, every, wait);
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) {
    const __m512 s = _mm512_loadu_ps(ws + q * PANEL);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N + q * PANEL, _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(f[q][r]), s), _mm512_set1_ps(xs[r])));
  }
}

// x [M, K] as int16 pairs with row scales xs, by int8 panels with scales ws: panels p0..p1 of y [M, N] (fp32)
static void panels_vnni(const int32_t* x, const float* xs, int64_t M, int64_t K, const int8_t* w, const float* ws, float* y, int64_t N,
                        int64_t p0, int64_t p1) {
  const int64_t K2 = K / 2;
  if (M <= DP_FEW) {
    using Few = void (*)(const int32_t*, const float*, int64_t, const int8_t*, const float*, float*, int64_t);
    static const Few f[DP_FEW + 1] = {nullptr, panel_vnni<1, 4>, panel_vnni<2, 2>, panel_vnni<3, 2>};
    for (int64_t p = p0; p < p1; ++p) f[M](x, xs, K2, w + p * K * PANEL, ws + p * PANEL, y + p * PANEL, N);
    return;
  }
  using F = void (*)(const int32_t*, const float*, int64_t, const int8_t*, const float*, float*, int64_t, const char*, int64_t);
#define LLM_VNNI_TILES(R) panel_vnni_tile<R, 1>, panel_vnni_tile<R, 2>, panel_vnni_tile<R, 3>, panel_vnni_tile<R, 4>
  static const F f[VNNI_ROWS][PANEL_BLOCK] = {{LLM_VNNI_TILES(1)}, {LLM_VNNI_TILES(2)}, {LLM_VNNI_TILES(3)}, {LLM_VNNI_TILES(4)}};
#undef LLM_VNNI_TILES
  tile_blocks(M, N, p0, p1, VNNI_ROWS, K * PANEL, (const char*)w, [&](int64_t m, int64_t r, int64_t b, int64_t n, const char* pf, int64_t pfn) {
    f[r - 1][n - 1](x + m * K2, xs + m, K2, w + b * K * PANEL, ws + b * PANEL, y + m * N + b * PANEL, N, pf, pfn);
  });
}
#endif

// whether bf16 panels take the bf16 dot product here (else fp32 multiply-adds on the widened weights)
static bool bf16_dot_product() {
#if defined(__AVX512F__)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

// an fp32 value's bf16 bits: rounded to nearest, ties to even, NaN kept (as a cast to bf16 gives them)
static inline uint16_t bf16_of(float v) {
  uint32_t u; std::memcpy(&u, &v, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static void bf16_bits(const float* x, int64_t n, uint16_t* out) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t i0, int64_t i1) { for (int64_t i = i0; i < i1; ++i) out[i] = bf16_of(x[i]); });
}

// y [M, N] (fp32 or bf16) = x [M, K] (bf16) times bf16 panels, by bf16 dot products (bf16_dot_product() must hold)
template <typename Y>
static void matmul_panels_dp(const uint16_t* xb, int64_t M, int64_t K, const at::BFloat16* wp, Y* yp, int64_t N) {
#if defined(__AVX512F__)
  balanced_for(N / PANEL, M <= DP_FEW ? 2 : PANEL_BLOCK, [&](int64_t p0, int64_t p1) { panels_dp((const int32_t*)xb, M, K, wp, yp, N, p0, p1); });
#else
  TORCH_CHECK(false, "bf16 dot products need the AVX-512 build");
#endif
}

template <typename W>
static void matmul_panels(const float* xp, int64_t M, int64_t K, const W* wp, const float* sp, float* yp, int64_t N, bool generic) {
  if constexpr (std::is_same_v<W, at::BFloat16>) if (!generic && bf16_dot_product()) {
    std::vector<uint16_t> xb(M * K);      // x rounded to bf16 once, read as k-pairs
    bf16_bits(xp, M * K, xb.data());
    return matmul_panels_dp(xb.data(), M, K, wp, yp, N);
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, int8_t>) if (!generic && int16_dot_product()) {
    const Int16Rows xr = round_rows_int16(xp, M, K);
    balanced_for(N / PANEL, M <= DP_FEW ? 2 : PANEL_BLOCK, [&](int64_t p0, int64_t p1) { panels_vnni((const int32_t*)xr.q, xr.scales, M, K, wp, sp, yp, N, p0, p1); });
    return;
  }
#endif
  balanced_for(N / PANEL, 2, [&](int64_t p0, int64_t p1) {
#if defined(__AVX512F__) || defined(LLM_AVX2)
    if (!generic) { panels_avx2(xp, M, K, wp, sp, yp, N, p0, p1); return; }
#endif
    panels_generic(xp, M, K, wp, sp, yp, N, p0, p1);
  });
}

// a panel tensor as every caller takes it: bf16 without scales, or int8 with one fp32 scale per output row; the
// scales' pointer (null for bf16)
static const float* check_panels(const at::Tensor& w, int64_t K, const at::Tensor& s, const char* what) {
  const auto t = w.scalar_type();
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && (t == at::kBFloat16 || t == at::kChar) && w.size(1) == K && w.size(2) == PANEL &&
              K % 2 == 0, what, ": panels are bf16 or int8 [N / 16, K, 16] (K even), contiguous, and x [M, K] shares their K");
  TORCH_CHECK(t == at::kChar ? s.numel() == out_rows(w) && s.scalar_type() == at::kFloat && s.is_contiguous() : !s.numel(),
              what, ": panels are bf16 without scales, or int8 with one scale per output channel");
  return t == at::kChar ? s.data_ptr<float>() : nullptr;
}

// y [M, N] = x [M, K] times panels [N / 16, K, 16]: bf16 (sp null) or int8 with scales [N]
static void matmul_panels_any(const float* xp, int64_t M, int64_t K, const at::Tensor& w, const float* sp, float* yp, bool generic) {
  const int64_t N = out_rows(w);
  if (w.scalar_type() == at::kChar) matmul_panels(xp, M, K, w.data_ptr<int8_t>(), sp, yp, N, generic);
  else matmul_panels(xp, M, K, w.data_ptr<at::BFloat16>(), (const float*)nullptr, yp, N, generic);
}

template <typename E, typename W>
static void pack_rows(const E* src, int64_t N, int64_t K, E* dst) {
  at::parallel_for(0, N / PANEL, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int r = 0; r < PANEL; ++r) {
        const E* row = src + (p * PANEL + r) * K; E* d = dst + p * K * PANEL;
        for (int64_t k = 0; k < K; ++k) d[panel_at<W>(r, k)] = row[k];
      }
  });
}

// w [N, K] bf16 or int8 -> its panels [N / 16, K, 16] (N a multiple of 16)
at::Tensor pack_panels(const at::Tensor& w_) {
  const auto t = w_.scalar_type();
  TORCH_CHECK(w_.dim() == 2 && (t == at::kBFloat16 || t == at::kChar) && w_.size(0) % PANEL == 0 && w_.size(1) % 2 == 0,
              "pack_panels: bf16 or int8 [N, K], N a multiple of 16 and K even");
  const at::Tensor w = w_.contiguous();
  at::Tensor out = at::empty({w.size(0) / PANEL, w.size(1), PANEL}, w.options());
  if (t == at::kChar) pack_rows<int8_t, int8_t>(w.data_ptr<int8_t>(), w.size(0), w.size(1), out.data_ptr<int8_t>());
  else pack_rows<uint16_t, at::BFloat16>((const uint16_t*)w.data_ptr<at::BFloat16>(), w.size(0), w.size(1), (uint16_t*)out.data_ptr<at::BFloat16>());
  return out;
}

template <typename E, typename W>
static void gather_rows(const E* src, const int64_t* ip, int64_t n, int64_t K, E* dst) {
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const E* s = src + ip[i] / PANEL * K * PANEL; const int64_t r = ip[i] % PANEL;
      for (int64_t k = 0; k < K; ++k) dst[i * K + k] = s[panel_at<W>(r, k)];
    }
  });
}

// rows `ids` of the weight a panel tensor holds, [len(ids), K] in its dtype: a tied table's lookups, the weight de-packed
at::Tensor panel_rows(const at::Tensor& p_, const at::Tensor& ids_) {
  const auto t = p_.scalar_type();
  TORCH_CHECK(p_.dim() == 3 && p_.size(2) == PANEL && (t == at::kBFloat16 || t == at::kChar), "panel_rows: bf16 or int8 panels [N / 16, K, 16]");
  const at::Tensor p = p_.contiguous(), ids = ids_.to(at::kLong).contiguous();
  const int64_t K = p.size(1), N = p.size(0) * PANEL, n = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "panel_rows: row ", ip[i], " out of range for ", N, " rows");
  at::Tensor out = at::empty({n, K}, p.options());
  if (t == at::kChar) gather_rows<int8_t, int8_t>(p.data_ptr<int8_t>(), ip, n, K, out.data_ptr<int8_t>());
  else gather_rows<uint16_t, at::BFloat16>((const uint16_t*)p.data_ptr<at::BFloat16>(), ip, n, K, (uint16_t*)out.data_ptr<at::BFloat16>());
  return out;
}

// x [M, K] fp32 or bf16, w [N, K] int8 with scales [N], or bf16 / fp32 with no scales -> [M, N] in x's dtype (the
// arithmetic is fp32). generic: use the portable loop even where a vector path is compiled in
at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& scales_, bool generic) {
  const auto wt = w_.scalar_type();
  if (w_.dim() == 3) {      // panels [N / 16, K, 16]: bf16, or int8 with its scales
    TORCH_CHECK(x_.dim() == 2, "int8_linear: x is [M, K]");
    if (wt == at::kBFloat16 && !generic && bf16_dot_product() && x_.scalar_type() == at::kBFloat16) {
      // bf16 x read as it is and y written in bf16 by the kernel (a prefill chunk's fp32 product, then cast, was a third
      // of its gate/up matmul's time: fresh pages for 6 MB, and a pass over them); fp32 x takes the path below
      check_panels(w_, x_.size(1), scales_, "int8_linear");
      const at::Tensor x = x_.contiguous(), w = w_.contiguous();
      at::Tensor y = at::empty({x.size(0), out_rows(w)}, x.options());
      matmul_panels_dp((const uint16_t*)x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), y.size(1));
      return y;
    }
    const at::Tensor x = x_.to(at::kFloat).contiguous(), w = w_.contiguous(), sc = scales_.to(at::kFloat).contiguous();
    const float* sp = check_panels(w, x.size(1), sc, "int8_linear");
    at::Tensor y = at::empty({x.size(0), out_rows(w)}, x.options());
    matmul_panels_any(x.data_ptr<float>(), x.size(0), x.size(1), w, sp, y.data_ptr<float>(), generic);
    return x_.scalar_type() == at::kFloat ? y : y.to(x_.scalar_type());
  }
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 2 && x_.size(1) == w_.size(1), "int8_linear: x [M, K] and w [N, K] must share K");
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
// A row of K weights (K a multiple of 64, G = K / 32 blocks) is laid out for the kernels rather than as the file has
// it, in groups of 16 blocks (512 weights; the row's last group has the n = G mod 16 blocks left, if any): the group's
// n scales d (fp16), its n minimums m, then 4 chunks of 4n bytes. In chunk c, the 4 bytes at 4i are block i's, two
// 16-bit words e = 0, 1, each holding four nibbles k = 0..3 (bits 4k..4k+3): nibble k of word e of chunk c is the
// block's weight j = 8k + 2c + e. So one 32-bit lane of a vector of chunk bytes belongs to one block, and its four
// nibble planes, each masked or shifted out in 16-bit lanes, meet the activations in multiply-adds whose 32-bit sums
// stay within their block: a 16-lane accumulator holds a group's 16 blocks, scaled by a vector of 16 d's at the end.
constexpr int64_t Q4_GROUP = 32, Q4_BYTES = 20, Q4_SPAN = 16;    // weights a block; bytes a block; blocks a group

static inline float half_bits(const uint8_t* p) {
  uint16_t h; std::memcpy(&h, p, 2); return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
// where group g of a row starts, and how many blocks it has
static inline const uint8_t* q4_group(const uint8_t* row, int64_t g) { return row + g * Q4_SPAN * Q4_BYTES; }
static inline int q4_blocks(int64_t G, int64_t g) { return (int)std::min<int64_t>(Q4_SPAN, G - g * Q4_SPAN); }
// one Q4 row's K = 32 G weights, d q + m in fp32 (one rounding), each rounded once to T, into o
template <typename T>
static void q4_expand_row(const uint8_t* row, int64_t G, T* o) {
  for (int64_t g = 0; g < (G + Q4_SPAN - 1) / Q4_SPAN; ++g) {
    const uint8_t* grp = q4_group(row, g); const int nb = q4_blocks(G, g);
    for (int i = 0; i < nb; ++i, o += Q4_GROUP) {
      const float d = half_bits(grp + 2 * i), mn = half_bits(grp + 2 * nb + 2 * i);
      for (int c = 0; c < 4; ++c)
        for (int e = 0; e < 2; ++e) {      // word e of block i in chunk c: its nibble k is weight 8k + 2c + e
          const uint8_t* b = grp + 4 * nb + 4 * nb * c + 4 * i + 2 * e;
          const unsigned word = b[0] | b[1] << 8;
          for (int k = 0; k < 4; ++k) o[8 * k + 2 * c + e] = static_cast<T>(std::fma(d, (float)(word >> 4 * k & 15), mn));
        }
    }
  }
}

// the portable path, exact fp32 (the weights d q + m, one rounding): any CPU, and the vector path's reference
static void block_q4_generic(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / Q4_GROUP;
  thread_local std::vector<float> wf;     // one weight row, expanded once for all the rows of x
  wf.resize(K);
  for (int64_t n = n0; n < n1; ++n) {
    q4_expand_row(w + n * G * Q4_BYTES, G, wf.data());
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * wf[k];
      y[m * N + n] = acc;
    }
  }
}

#if defined(__AVX512F__) || defined(LLM_AVX2)
// The vector kernels multiply in integers. No CPU multiplies a 4-bit weight by an fp32 activation: widening each
// nibble to fp32 took more instructions than the multiply-add, and bound a one-row step below the memory's pace
// (AVX-512 with a 16-float lookup table: 20 billion weights a second a core from L2). So each activation is rounded
// to 16 bits per block of 32 (the weights' blocks): x = d_x q_x, d_x = max|x| / 32767, |q_x| <= 32767, and the
// nibbles meet them in vpmaddwd (16 x 16-bit products, pairs added in 32 bits: at most 2 * 15 * 32767, 16 of them
// per lane and group, far from overflow). A block adds d_w d_x sum(q_w q_x) + m_w sum(x): the minimum meets the
// block's exact fp32 sum, and the activations are off by at most max|x| / 65,534 (a few parts in 1e5 of a result;
// one byte alone, as llama.cpp's Q8_1 rounds, moved SmolLM2's greedy choice off fp32's at 2.7% of positions, against
// 1%). Activations are laid out as the weights' nibble planes come out: per row and group 512 q_x (chunk c, plane k:
// 32 words, word 2i + e of block i's weight 8k + 2c + e; blocks past the row's end zero), then 16 d_x, 16 sums. A
// last group of 8 blocks or fewer is read two chunks to a 16-lane vector (blocks 0-7 of chunk c, then of chunk c + 1),
// so its activations are laid out in that order (pair u = c / 2, plane k: chunk 2u's 16 words, then chunk 2u + 1's),
// and its d_x are repeated in the upper 8 lanes (its sums are not: each block's minimum term counts once).
struct Q4Acts { std::vector<int16_t> q; std::vector<float> d, s; int64_t S = 0; };

// where weight j of block 0 goes in a group's activations (block i: 2i further), for a full group and a short one
static const struct Q4ActAt {
  int at[2][Q4_GROUP];
  Q4ActAt() {
    for (int j = 0; j < Q4_GROUP; ++j) {
      const int c = j / 2 % 4, k = j / 8, e = j % 2;
      at[0][j] = (c * 4 + k) * 32 + e; at[1][j] = c / 2 * 128 + k * 32 + c % 2 * 16 + e;
    }
  }
  const int* operator[](bool short_group) const { return at[short_group]; }
} Q4_ACT_AT;

static void quantize_q4_acts(const float* x, int64_t M, int64_t K, Q4Acts& a) {
  const int64_t G = K / Q4_GROUP, S = (G + Q4_SPAN - 1) / Q4_SPAN;
  a.S = S; a.q.assign(M * S * 512, 0); a.d.assign(M * S * Q4_SPAN, 0.f); a.s.assign(M * S * Q4_SPAN, 0.f);
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < G; ++b) {
      const int64_t g = b / Q4_SPAN; const int i = (int)(b % Q4_SPAN);
      const float* xb = x + m * K + b * Q4_GROUP;
      float amax = 0.f, s = 0.f, sa = 0.f;
      for (int j = 0; j < Q4_GROUP; ++j) { amax = std::max(amax, std::fabs(xb[j])); s += xb[j]; sa += std::fabs(xb[j]); }
      float d = amax / 32767.f;
      if (nonfinite(sa)) d = s = quiet_nan();                 // a NaN scale: zeros here, and the NaN multiplied in
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int16_t* q = a.q.data() + (m * S + g) * 512 + 2 * i;
      const bool short_group = q4_blocks(G, g) <= 8;
      const int* at = Q4_ACT_AT[short_group];
      for (int j = 0; j < Q4_GROUP; ++j) q[at[j]] = (int16_t)std::nearbyint(std::min(32767.f, std::max(-32767.f, xb[j] * inv)));
      a.d[(m * S + g) * Q4_SPAN + i] = d; a.s[(m * S + g) * Q4_SPAN + i] = s;
      if (short_group) a.d[(m * S + g) * Q4_SPAN + 8 + i] = d;     // its upper 8 lanes hold the same blocks (below)
    }
  });
}
#endif

#if defined(__AVX512F__)
// group g of a weight row against R rows' activations, into acc: its 4 chunks are 4 loads (masked: a short last group
// reads only its own bytes), each split into 4 nibble planes that every row reuses. SHORT: a last group of 8 blocks or
// fewer, two chunks a load, spread to lanes 0-7 and 8-15 (half the passes over 16 mostly empty lanes)
template <int R, bool SHORT>
static inline void q4_group_avx512(const Q4Acts& a, int64_t m0, const uint8_t* grp, int nb, int64_t g, __m512* acc) {
  const int64_t S = a.S;
  const __m512i low4 = _mm512_set1_epi16(15);
  const __mmask16 lanes = (__mmask16)(SHORT ? ((1u << nb) - 1) * 0x101u : (1u << nb) - 1);
  __m512i sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
  for (int c = 0; c < (SHORT ? 2 : 4); ++c) {
    const __m512i v = SHORT ? _mm512_maskz_expandloadu_epi32(lanes, grp + 4 * nb + 8 * nb * c)
                            : _mm512_maskz_loadu_epi32(lanes, grp + 4 * nb + 4 * nb * c);
    const __m512i p[4] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                          _mm512_and_si512(_mm512_srli_epi16(v, 8), low4), _mm512_srli_epi16(v, 12)};
    for (int r = 0; r < R; ++r) {
      const int16_t* xq = a.q.data() + ((m0 + r) * S + g) * 512 + 128 * c;
      const __m512i s01 = _mm512_add_epi32(_mm512_madd_epi16(p[0], _mm512_loadu_si512(xq)), _mm512_madd_epi16(p[1], _mm512_loadu_si512(xq + 32)));
      const __m512i s23 = _mm512_add_epi32(_mm512_madd_epi16(p[2], _mm512_loadu_si512(xq + 64)), _mm512_madd_epi16(p[3], _mm512_loadu_si512(xq + 96)));
      sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(s01, s23));
    }
  }
  const __m512 dw = _mm512_cvtph_ps(SHORT ? _mm256_broadcastsi128_si256(_mm_maskz_loadu_epi16((__mmask8)lanes, grp))
                                          : _mm256_maskz_loadu_epi16(lanes, grp));
  const __m512 mw = _mm512_cvtph_ps(SHORT ? _mm256_broadcastsi128_si256(_mm_maskz_loadu_epi16((__mmask8)lanes, grp + 2 * nb))
                                          : _mm256_maskz_loadu_epi16(lanes, grp + 2 * nb));
  for (int r = 0; r < R; ++r) {
    const int64_t at = ((m0 + r) * S + g) * Q4_SPAN;
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(dw, _mm512_loadu_ps(a.d.data() + at)), acc[r]);
    acc[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(a.s.data() + at), acc[r]);
  }
}

// one weight row against R rows' activations
template <int R>
static void row_q4_avx512(const Q4Acts& a, int64_t m0, int64_t K, const uint8_t* wr, float* y, int64_t N) {
  const int64_t G = K / Q4_GROUP, S = a.S;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < S; ++g) {
    const uint8_t* grp = q4_group(wr, g); const int nb = q4_blocks(G, g);
    if (weight_prefetch) for (int l = 0; l < 5; ++l) _mm_prefetch((const char*)grp + 64 * l + weight_prefetch, _MM_HINT_T0);
    if (nb > 8) q4_group_avx512<R, false>(a, m0, grp, nb, g, acc);
    else q4_group_avx512<R, true>(a, m0, grp, nb, g, acc);
  }
  for (int r = 0; r < R; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(LLM_AVX2)
// the same with 8 lanes: a group's blocks 0-7, then 8-15, each half its own pass over the 4 chunks
template <int R>
static void row_q4_avx2(const Q4Acts& a, int64_t m0, int64_t K, const uint8_t* wr, float* y, int64_t N) {
  const int64_t G = K / Q4_GROUP, S = a.S;
  const __m256i low4 = _mm256_set1_epi16(15);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < S; ++g) {
    const uint8_t* grp = q4_group(wr, g); const int nb = q4_blocks(G, g);
    if (weight_prefetch) for (int l = 0; l < 5; ++l) _mm_prefetch((const char*)grp + 64 * l + weight_prefetch, _MM_HINT_T0);
    for (int h = 0; 8 * h < nb; ++h) {
      const int nh = std::min(8, nb - 8 * h);
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(nh), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i sum[R];
      for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const int* src = (const int*)(grp + 4 * nb + 4 * nb * c + 32 * h);
        const int64_t xo = nb <= 8 ? c / 2 * 128 + c % 2 * 16 : 128 * c + 16 * h;   // where chunk c's activations are
        const __m256i v = nh == 8 ? _mm256_loadu_si256((const __m256i*)src) : _mm256_maskload_epi32(src, lanes);
        const __m256i p[4] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(v, 8), low4), _mm256_srli_epi16(v, 12)};
        for (int r = 0; r < R; ++r) {
          const int16_t* xq = a.q.data() + ((m0 + r) * S + g) * 512 + xo;
          const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(p[0], _mm256_loadu_si256((const __m256i*)xq)),
                                               _mm256_madd_epi16(p[1], _mm256_loadu_si256((const __m256i*)(xq + 32))));
          const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(p[2], _mm256_loadu_si256((const __m256i*)(xq + 64))),
                                               _mm256_madd_epi16(p[3], _mm256_loadu_si256((const __m256i*)(xq + 96))));
          sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(s01, s23));
        }
      }
      // a short half's d and m: 8 halves read, those past the group's blocks (its m's, its nibbles) zeroed
      const __m256 keep = _mm256_castsi256_ps(lanes);
      const __m256 dw = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(grp + 16 * h))), keep);
      const __m256 mw = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(grp + 2 * nb + 16 * h))), keep);
      for (int r = 0; r < R; ++r) {
        const int64_t at = ((m0 + r) * S + g) * Q4_SPAN + 8 * h;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(dw, _mm256_loadu_ps(a.d.data() + at)), acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a.s.data() + at), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = hsum8(acc[r]);
}
#endif

static void matmul_q4_into(const float* xp, int64_t M, int64_t K, const uint8_t* wp, float* yp, int64_t N, bool generic) {
#if defined(__AVX512F__) || defined(LLM_AVX2)
  thread_local Q4Acts acts_;       // the calling thread's; the workers below read it through `acts`
  Q4Acts& acts = acts_;
  if (!generic) quantize_q4_acts(xp, M, K, acts);
#if defined(__AVX512F__)
  static void (*const rows[RB + 1])(const Q4Acts&, int64_t, int64_t, const uint8_t*, float*, int64_t) =
      {nullptr, row_q4_avx512<1>, row_q4_avx512<2>, row_q4_avx512<3>, row_q4_avx512<4>};
#else
  static void (*const rows[RB + 1])(const Q4Acts&, int64_t, int64_t, const uint8_t*, float*, int64_t) =
      {nullptr, row_q4_avx2<1>, row_q4_avx2<2>, row_q4_avx2<3>, row_q4_avx2<4>};
#endif
#endif
  balanced_for(N, 32, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512F__) || defined(LLM_AVX2)
    if (!generic) {     // each weight row against the rows of x RB at a time, while the weight row stays in L1
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; m += RB)
          rows[std::min<int64_t>(RB, M - m)](acts, m, K, wp + n * K / Q4_GROUP * Q4_BYTES, yp + m * N + n, N);
      return;
    }
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
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) q4_expand_row(wp + n * G * Q4_BYTES, G, op + n * G * Q4_GROUP);
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
  const int64_t N = out_rows(w);
  if (w.dim() == 3) return matmul_panels_any(x, M, K, w, check_panels(w, K, s, "decode_layer"), y, false);
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
static void store_qkv_row(const float* row, T* qp, T* kc, T* vc, int64_t slot, int64_t Q, int64_t KV) {
  for (int64_t i = 0; i < Q; ++i) qp[i] = static_cast<T>(row[i]);
  for (int64_t i = 0; i < KV; ++i) { kc[slot * KV + i] = static_cast<T>(row[Q + i]); vc[slot * KV + i] = static_cast<T>(row[Q + KV + i]); }
}

// fp32 values rounded in place to the nearest bf16 (ties to even, NaN kept), as a cast to bf16 and back gives them
static void round_to_bf16(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) { const uint32_t u = (uint32_t)bf16_of(p[i]) << 16; std::memcpy(p + i, &u, 4); }
}

// f(m) for each row m < M, the rows split between the threads: the work between a layer's matmuls ran on the main
// thread alone while the other spun in libgomp (SmolLM2, 32 rows under AVX2: 15% of the worker's samples); a few rows stay
// on one thread, where a parallel region costs more than it saves
template <typename F>
static void rows_for(int64_t M, const F& f) {
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) { for (int64_t m = m0; m < m1; ++m) f(m); });
}

// one layer on fp32 rows x [M, H]; `res` (fp32, this call's to write: the residual, or where the first layer starts it
// from x when `has_res` is false) is updated in place. The output and the residual come back rounded to T's precision,
// as a layer in T would leave them, but held in fp32: the next layer reads them without a conversion (SmolLM2, 32 bf16
// rows on AVX2: 220 small copies a step before, 46 now, the same tokens and log-probabilities)
static at::Tensor decode_layer(
    const at::Tensor& x, at::Tensor& res, bool has_res, at::ScalarType T, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
    const at::Tensor& bqkv, const at::Tensor& wqkv, const at::Tensor& sqkv, const at::Tensor& wo, const at::Tensor& so,
    const at::Tensor& wgu, const at::Tensor& sgu, const at::Tensor& wd, const at::Tensor& sd,
    const at::Tensor& c, const at::Tensor& s, int64_t nh, int64_t nkv, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& sl, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const int64_t M = x.size(0), H = x.size(1), D = k_cache.size(3), Q = nh * D, KV = nkv * D, I = out_rows(wgu) / 2;
  TORCH_CHECK(out_rows(wqkv) == Q + 2 * KV && out_rows(wo) == H && out_rows(wd) == H, "decode_layer: weight shapes");
  TORCH_CHECK(!bqkv.numel() || bqkv.numel() == Q + 2 * KV, "decode_layer: the qkv bias is empty or one per output");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == T && v_cache.scalar_type() == T &&
              k_cache.size(2) == nkv, "decode_layer: contiguous caches [blocks, block_size, kv_heads, D] in the activations' dtype");
  TORCH_CHECK(c.size(0) == M && c.size(1) == D / 2 && sl.scalar_type() == at::kLong && sl.numel() == M, "decode_layer: cos, sin, slots");
  auto opt = x.options().dtype(at::kFloat), topt = x.options().dtype(T);
  at::Tensor h = at::empty({M, H}, opt), qkv = at::empty({M, Q + 2 * KV}, opt), q = at::empty({M, nh, D}, topt);
  at::Tensor att = at::empty({M, nh, D}, topt), gu = at::empty({M, 2 * I}, opt), act = at::empty({M, I}, opt), y = at::empty({M, H}, opt);
  float *rp = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *w1 = f32(ln1, "ln1"), *w2 = f32(ln2, "ln2");
  rows_for(M, [&](int64_t m) {      // the first layer has no residual yet: it starts as x
    add_rms_norm_row(has_res ? rp + m * H : xp + m * H, has_res ? xp + m * H : nullptr, rp + m * H, w1, hp + m * H, H, (float)eps);
  });
  mm(hp, M, H, wqkv, sqkv, qkvp);
  const float *bp = bqkv.numel() ? f32(bqkv, "qkv bias") : nullptr, *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  rows_for(M, [&](int64_t m) {      // rows write distinct cache slots
    float* row = qkvp + m * (Q + 2 * KV);
    if (bp) for (int64_t i = 0; i < Q + 2 * KV; ++i) row[i] += bp[i];      // before RoPE, as the module adds it
    for (int64_t hd = 0; hd < nh + nkv; ++hd)      // q's heads, then k's: adjacent in the row
      rope_head(row + hd * D, row + hd * D, D / 2, cp + m * (D / 2), sp + m * (D / 2));
    if (T == at::kFloat) store_qkv_row(row, q.data_ptr<float>() + m * Q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slp[m], Q, KV);
    else store_qkv_row(row, q.data_ptr<at::BFloat16>() + m * Q, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), slp[m], Q, KV);
  });
  static auto decode = c10::Dispatcher::singleton().findSchemaOrThrow("llm_engine::paged_decode", "")
      .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, double)>();
  decode.call(att, q, k_cache, v_cache, block_tables, context_lens, scale, 0, 0.0);
  const at::Tensor attf = att.to(at::kFloat).contiguous();
  mm(attf.data_ptr<float>(), M, Q, wo, so, y.data_ptr<float>());
  float *yp = y.data_ptr<float>(), *gp = gu.data_ptr<float>(), *ap = act.data_ptr<float>();
  rows_for(M, [&](int64_t m) { add_rms_norm_row(rp + m * H, yp + m * H, rp + m * H, w2, hp + m * H, H, (float)eps); });
  mm(hp, M, H, wgu, sgu, gp);
  rows_for(M, [&](int64_t m) { silu_mul_row(gp + m * 2 * I, ap + m * I, I); });
  mm(ap, M, I, wd, sd, yp);
  if (T == at::kBFloat16) rows_for(M, [&](int64_t m) { round_to_bf16(yp + m * H, H); round_to_bf16(rp + m * H, H); });
  return y;
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
  const auto T = x.scalar_type();
  TORCH_CHECK(T == at::kFloat || T == at::kBFloat16, "decode_layer: fp32 or bf16 activations");
  // fp32 from here to the last layer: the residual is this call's copy, written in place by each layer
  at::Tensor h = x.to(at::kFloat).contiguous();
  const bool has_res = residual.numel() > 0;
  at::Tensor r = has_res ? residual.to(at::kFloat, false, true).contiguous() : at::empty_like(h);
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous(), sl = slots.contiguous();
  for (size_t i = 0; i < L; ++i)
    h = decode_layer(h, r, has_res || i > 0, T, ln1[i], ln2[i], eps, bqkv[i], wqkv[i], sqkv[i], wo[i], so[i], wgu[i], sgu[i], wd[i], sd[i], c, s,
                     nh, nkv, k_caches[i], v_caches[i], sl, block_tables, context_lens, scale);
  return {h.to(T), r.to(T)};
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
// Row m of x, divided by the smoothing factors s, becomes q in 0..levels with a scale a[m] and a zero point z[m]
// (x/s ~ a * (q - z)): the row's own [min, max], widened to hold 0, spread over all the levels. `levels` is 255, or 127
// where the CPU has no VNNI: its 8-bit multiply-adds sum pairs of u8 x s8 products in 16 bits, which saturate unless
// the unsigned side stays below 128. With `to_signed` q - 128 and z - 128 come back, the int8 form `_int_mm` takes.
// A row with a non-finite value gets a NaN scale and zeros, so the NaN reaches the output as it would in fp32 (the sum
// carries it: -ffast-math may drop a NaN from the max).
template <typename T, typename S, typename Q>
static void quantize_row(const T* x, const S* s, int64_t K, Q* q, float* a, float* z, float levels, int shift) {
  float lo = 0.f, hi = 0.f, sum = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = static_cast<float>(x[k]) / static_cast<float>(s[k]);
    lo = std::min(lo, v); hi = std::max(hi, v); sum += std::fabs(v);
  }
  if (nonfinite(sum)) { std::fill(q, q + K, static_cast<Q>(-shift)); *a = quiet_nan(); *z = 0.f; return; }
  const float scale = std::max(hi - lo, 1e-30f) / levels, zero = std::nearbyint(-lo / scale);
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::nearbyint(static_cast<float>(x[k]) / static_cast<float>(s[k]) / scale) + zero;
    q[k] = static_cast<Q>(static_cast<int>(std::max(0.f, std::min(levels, v))) - shift);
  }
  *a = scale; *z = zero - shift;
}

// the smoothing factors and scales come as the model holds them: fp32, or bf16 in a model cast to bf16
#define DISPATCH_SCALES(t, ...) \
  if ((t).scalar_type() == at::kFloat) { using S = float; __VA_ARGS__(); } \
  else { TORCH_CHECK((t).scalar_type() == at::kBFloat16, "scales: fp32 or bf16"); using S = at::BFloat16; __VA_ARGS__(); }

// (q, a, z): q uint8 [M, K] (int8 with `to_signed`), the rows' scales a and zero points z, fp32 [M, 1]
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_, const at::Tensor& s_, int64_t levels, bool to_signed) {
  const at::Tensor x = x_.contiguous(), s = s_.contiguous();
  TORCH_CHECK(x.dim() == 2 && s.numel() == x.size(1), "quantize_rows: x [M, K] and one smoothing factor per column");
  TORCH_CHECK(levels >= 1 && levels <= 255 && (!to_signed || levels == 255), "quantize_rows: levels in 1..255 (255 for int8 out)");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(to_signed ? at::kChar : at::kByte));
  at::Tensor a = at::empty({M, 1}, x.options().dtype(at::kFloat)), z = at::empty({M, 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_rows", [&] {
    DISPATCH_SCALES(s, [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>(); const S* sp = s.data_ptr<S>(); float* ap = a.data_ptr<float>(); float* zp = z.data_ptr<float>();
      at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          if (to_signed) quantize_row(xp + m * K, sp, K, q.data_ptr<int8_t>() + m * K, ap + m, zp + m, (float)levels, 128);
          else quantize_row(xp + m * K, sp, K, q.data_ptr<uint8_t>() + m * K, ap + m, zp + m, (float)levels, 0);
        }
      });
    });
  });
  return {q, a, z};
}

// y [M, N] = a[m] * (acc[m, n] * w[n] - z[m] * c[n]): acc is the product of the quantized rows and the int8 weights
// (int32, or fp32 that already carries the columns' scales: w empty), c[n] the weight column's sum times its scale, so
// that z's share of the product goes again (z and c empty: none)
at::Tensor dequantize_rows(const at::Tensor& acc_, const at::Tensor& a_, const at::Tensor& w_, at::ScalarType dtype,
                           const at::Tensor& z_, const at::Tensor& c_) {
  const at::Tensor acc = acc_.contiguous(), a = a_.contiguous(), w = w_.contiguous(), z = z_.contiguous(), c = c_.contiguous();
  TORCH_CHECK((acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat) && acc.dim() == 2 && a.scalar_type() == at::kFloat &&
              a.numel() == acc.size(0) && (w.numel() == acc.size(1) || w.numel() == 0), "dequantize_rows: int32 or fp32 acc [M, N], fp32 a [M], w [N] or empty");
  const int64_t M = acc.size(0), N = acc.size(1);
  const bool shifted = z.numel() > 0;
  TORCH_CHECK(!shifted || (z.scalar_type() == at::kFloat && z.numel() == M && c.scalar_type() == at::kFloat && c.numel() == N),
              "dequantize_rows: fp32 zero points z [M] with fp32 column sums c [N], or both empty");
  at::Tensor y = at::empty({M, N}, acc.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "dequantize_rows", [&] {
    const float* ap = a.data_ptr<float>(); scalar_t* yp = y.data_ptr<scalar_t>();
    const float* zp = shifted ? z.data_ptr<float>() : nullptr; const float* cp = shifted ? c.data_ptr<float>() : nullptr;
    auto rows = [&](auto* accp, auto* wp) {
      at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          const float am = ap[m], zm = shifted ? zp[m] : 0.f; const auto* r = accp + m * N; scalar_t* o = yp + m * N;
          for (int64_t n = 0; n < N; ++n) {
            const float v = static_cast<float>(r[n]) * (wp ? static_cast<float>(wp[n]) : 1.f);
            o[n] = static_cast<scalar_t>(am * (shifted ? v - zm * cp[n] : v));
          }
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
// the kernel bf16 panels take here, for the tests and the logs
std::string bf16_panel_kernel() { return bf16_dot_product() ? "avx512_bf16 dot product" : has_vector_path() ? "fp32 fma" : "generic"; }
int64_t panel_height() { return PANEL; }
// the kernel int8 panels take here (every batch)
std::string int8_panel_kernel() {
#if defined(__AVX512F__)
  if (int16_dot_product()) return "avx512_vnni int16 dot product";
#endif
  return has_vector_path() ? "fp32 fma" : "generic";
}
// the kernel a few rows of x take on plain int8 weights here (a K that is a multiple of 32, up to VNNI_MAX_K)
std::string int8_row_kernel() {
#if defined(__AVX512F__)
  if (int16_dot_product()) return "avx512_vnni int16 dot product";
#endif
  return has_vector_path() ? "fp32 fma" : "generic";
}
// how far ahead the few-row kernels ask for weights, in bytes (0: not at all), for the tests and the logs
#if defined(__AVX512F__) || defined(LLM_AVX2)
int64_t weight_prefetch_bytes() { return weight_prefetch; }
#else
int64_t weight_prefetch_bytes() { return 0; }
#endif
std::string step_kernels_isa() { return kernel_isa(); }

TORCH_LIBRARY_FRAGMENT(llm_engine, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, bool generic=False) -> Tensor");
  m.def("int8_linear_vectorized() -> bool", &int8_linear_vectorized);
  m.def("step_kernels_isa() -> str", &step_kernels_isa);
  m.def("panel_height() -> int", &panel_height);
  m.def("bf16_panel_kernel() -> str", &bf16_panel_kernel);
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("weight_prefetch_bytes() -> int", &weight_prefetch_bytes);
  m.def("int8_row_kernel() -> str", &int8_row_kernel);
  m.def("int8_panel_kernel() -> str", &int8_panel_kernel);
  m.def("panel_rows(Tensor panels, Tensor ids) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor w, bool generic=False) -> Tensor");
  m.def("q4_dequantize(Tensor w, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, int nh, int nkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("quantize_rows(Tensor x, Tensor smooth, int levels=255, bool to_signed=False) -> (Tensor, Tensor, Tensor)");
  m.def("dequantize_rows(Tensor acc, Tensor row_scales, Tensor col_scales, ScalarType dtype, Tensor zero_points, Tensor col_sums) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor residual, Tensor[] ln1, Tensor[] ln2, float eps, Tensor[] bqkv, Tensor[] wqkv, Tensor[] sqkv, "
        "Tensor[] wo, Tensor[] so, Tensor[] wgu, Tensor[] sgu, Tensor[] wd, Tensor[] sd, Tensor cos, Tensor sin, int nh, int nkv, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor block_tables, Tensor context_lens, float scale) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(llm_engine, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("pack_panels", pack_panels);
  m.impl("panel_rows", panel_rows);
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
