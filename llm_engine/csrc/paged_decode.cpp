// Paged decode attention for the CPU: one query per sequence against its K/V read in place through its block table.
// Loaded by llm_engine.attention.load_decode_kernel (compiled on first use, cached by a hash of this file).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

// An 8-bit cache (notebook 03) holds int8 codes, or fp8 e4m3 codes read as bytes, with one fp32 scale per block and
// KV head. widen() gives a code's value divided by unit<C>(): for e4m3 its sign, exponent and mantissa are moved to
// fp32's places, which is exact for normal and subnormal codes alike once multiplied by 2^120 (the bias difference,
// 127 - 7); that factor is folded into the block's scale, so it costs nothing per element.
struct fp8e4m3 { uint8_t bits; };
static inline float widen(float x) { return x; }
static inline float widen(at::BFloat16 x) { return static_cast<float>(x); }
static inline float widen(int8_t x) { return static_cast<float>(x); }
static inline float widen(fp8e4m3 x) {
  const uint32_t u = (uint32_t(x.bits & 0x80) << 24) | (uint32_t(x.bits & 0x7F) << 20);
  float f; std::memcpy(&f, &u, 4); return f;
}
template <typename C> constexpr float unit() { return 1.f; }
template <> constexpr float unit<fp8e4m3>() { return 0x1p120f; }
#ifdef __AVX512F__
#include <immintrin.h>

// The vector path (head_dim 64 or 128, NC = head_dim / 16 registers a row): the heads that share a KV head (GQA)
// are done together, so each key and value row is loaded and widened to fp32 once for all of them, not once per head.
static inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16(const at::BFloat16* p) {     // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 ld16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline __m512 ld16(const fp8e4m3* p) {         // as widen() above, sixteen at a time
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24),
                                             _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20)));
}

// four horizontal sums at once: lane j of the result is the sum of a_j's 16 lanes
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto half = [](__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))); };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s[h * L + t] = sc * q_h . k_t for NH heads (q rows D apart) and the n key rows at kk (kt apart); four keys at a
// time where the registers allow, so that their sums across lanes are shared
template <typename T, int NC, int NH>
static void scores_group(const float* q, int64_t D, const T* kk, int64_t kt, int64_t n, float* s, int64_t L, float sc) {
  __m512 qv[NH][NC];
  for (int h = 0; h < NH; ++h) for (int c = 0; c < NC; ++c) qv[h][c] = _mm512_loadu_ps(q + h * D + c * 16);
  auto dot = [&](const __m512* kv, int h) {
    __m512 a = _mm512_mul_ps(qv[h][0], kv[0]);
    for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[h][c], kv[c], a);
    return a;
  };
  int64_t t = 0;
  if constexpr (NH * NC + 4 * NH + NC <= 32) {
    const __m128 scv = _mm_set1_ps(sc);
    for (; t + 4 <= n; t += 4) {
      __m512 acc[NH][4];
      for (int j = 0; j < 4; ++j) {
        __m512 kv[NC];
        for (int c = 0; c < NC; ++c) kv[c] = ld16(kk + (t + j) * kt + c * 16);
        for (int h = 0; h < NH; ++h) acc[h][j] = dot(kv, h);
      }
      for (int h = 0; h < NH; ++h) _mm_storeu_ps(s + h * L + t, _mm_mul_ps(reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), scv));
    }
  }
  for (; t < n; ++t) {
    __m512 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = ld16(kk + t * kt + c * 16);
    for (int h = 0; h < NH; ++h) s[h * L + t] = _mm512_reduce_add_ps(dot(kv, h)) * sc;
  }
}

// o_h += sum_t p[h * L + t] * v_t for NH heads (outputs D apart) and the n value rows at vv (vt apart)
template <typename T, int NC, int NH>
static void values_group(const float* p, int64_t L, const T* vv, int64_t vt, int64_t n, float* o, int64_t D, float vs) {
  __m512 acc[NH][NC];
  for (int h = 0; h < NH; ++h) for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_loadu_ps(o + h * D + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = ld16(vv + t * vt + c * 16);
    for (int h = 0; h < NH; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * L + t] * vs);
      for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + h * D + c * 16, acc[h][c]);
}

#define NH_SWITCH(nh, F, ...) switch (nh) { case 1: F<C, NC, 1>(__VA_ARGS__); break; case 2: F<C, NC, 2>(__VA_ARGS__); break; \
  case 3: if constexpr (NC <= 5) F<C, NC, 3>(__VA_ARGS__); break; case 4: if constexpr (NC <= 4) F<C, NC, 4>(__VA_ARGS__); break; }
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLM_AVX2 1
#include <immintrin.h>
// The AVX2 path, same plan in 8 lanes (NC = head_dim / 8 registers a row): the heads that share a KV head widen each
// key and value row once for all of them. With 16 registers the query is read from L1 by each multiply-add rather
// than held, and at most 4 heads go together. The portable loops it replaces (vectorized by the compiler, each head
// widening every row again) ran SmolLM2's 9 / 3 heads at 32 rows and 200 keys at 26 GFLOP/s with a bf16 cache.
static inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 ld8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline __m256 ld8(const fp8e4m3* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24),
                                             _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20)));
}
// lane j of the result: the sum of a_j's 8 lanes
static inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// s[h * L + t] = sc * q_h . k_t for NH heads and the n key rows at kk: J keys at a time (NH * J sums, J keys in registers)
template <typename T, int NC, int NH>
static void scores_group(const float* q, int64_t D, const T* kk, int64_t kt, int64_t n, float* s, int64_t L, float sc) {
  constexpr int J = NH <= 2 ? 4 : 2;
  const __m128 scv = _mm_set1_ps(sc); const __m256 zero = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + J <= n; t += J) {
    __m256 acc[NH][J];
    for (int h = 0; h < NH; ++h) for (int j = 0; j < J; ++j) acc[h][j] = zero;
    for (int c = 0; c < NC; ++c) {
      __m256 kv[J];
      for (int j = 0; j < J; ++j) kv[j] = ld8(kk + (t + j) * kt + c * 8);
      for (int h = 0; h < NH; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * D + c * 8);
        for (int j = 0; j < J; ++j) acc[h][j] = _mm256_fmadd_ps(qv, kv[j], acc[h][j]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      if constexpr (J == 4) _mm_storeu_ps(s + h * L + t, _mm_mul_ps(reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), scv));
      else _mm_storel_pi((__m64*)(s + h * L + t), _mm_mul_ps(reduce4(acc[h][0], acc[h][1], zero, zero), scv));
    }
  }
  for (; t < n; ++t) {
    __m256 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = zero;
    for (int c = 0; c < NC; ++c) {
      const __m256 kv = ld8(kk + t * kt + c * 8);
      for (int h = 0; h < NH; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + c * 8), kv, acc[h]);
    }
    for (int h = 0; h < NH; ++h) s[h * L + t] = _mm_cvtss_f32(reduce4(acc[h], zero, zero, zero)) * sc;
  }
}

// o_h += sum_t p[h * L + t] * v_t for NH heads: CB registers of each output row a pass over the n value rows
template <typename T, int NC, int NH>
static void values_group(const float* p, int64_t L, const T* vv, int64_t vt, int64_t n, float* o, int64_t D, float vs) {
  constexpr int CB = NH == 1 ? 8 : NH == 2 ? 4 : 2;
  for (int c0 = 0; c0 < NC; c0 += CB) {
    __m256 acc[NH][CB];
    for (int h = 0; h < NH; ++h) for (int c = 0; c < CB; ++c) acc[h][c] = _mm256_loadu_ps(o + h * D + (c0 + c) * 8);
    for (int64_t t = 0; t < n; ++t) {
      __m256 w[NH];
      for (int h = 0; h < NH; ++h) w[h] = _mm256_set1_ps(p[h * L + t] * vs);
      for (int c = 0; c < CB; ++c) {
        const __m256 v = ld8(vv + t * vt + (c0 + c) * 8);
        for (int h = 0; h < NH; ++h) acc[h][c] = _mm256_fmadd_ps(w[h], v, acc[h][c]);
      }
    }
    for (int h = 0; h < NH; ++h) for (int c = 0; c < CB; ++c) _mm256_storeu_ps(o + h * D + (c0 + c) * 8, acc[h][c]);
  }
}

#define NH_SWITCH(nh, F, ...) switch (nh) { case 1: F<C, NC, 1>(__VA_ARGS__); break; case 2: F<C, NC, 2>(__VA_ARGS__); break; \
  case 3: F<C, NC, 3>(__VA_ARGS__); break; case 4: F<C, NC, 4>(__VA_ARGS__); break; }
#endif

#if defined(__AVX512F__)
constexpr int VEC_LANES = 16;
template <int NC> constexpr int64_t heads_at_once() { return 16 / NC; }    // the registers they need (32 of them)
template <typename C, int DC> constexpr bool vector_path() { return DC == 64 || DC == 128; }
#elif defined(LLM_AVX2)
constexpr int VEC_LANES = 8;
template <int NC> constexpr int64_t heads_at_once() { return 4; }          // 16 registers: see scores_group, values_group
// not for an fp32 cache, which has nothing to widen: there the compiler's loops below ran faster than these (32 rows of
// SmolLM2's or TinyLlama's heads, 100-250 keys: 0.94 and 1.91 ms a layer against 1.13 and 2.28), where they made a bf16
// cache 1.2-1.5x faster, int8 1.4-2.0x and fp8 1.8-2.4x (`nbs/03`'s timing cell gives this machine's figures)
template <typename C, int DC> constexpr bool vector_path() { return (DC == 64 || DC == 128) && !std::is_same_v<C, float>; }
#endif
#if defined(__AVX512F__) || defined(LLM_AVX2)
// heads h0..h1-1 of a sequence in runs that share a KV head, at most heads_at_once<NC>() at a time
template <int NC, typename F>
static void head_runs(int64_t h0, int64_t h1, int64_t G, F&& fn) {
  for (int64_t h = h0; h < h1;) {
    const int64_t e = std::min({h1, (h / G + 1) * G, h + heads_at_once<NC>()});
    fn(h, e - h); h = e;
  }
}
#endif

// one sequence's heads h0..h1-1: scores, softmax, weighted values. T: the query's and output's element type (float or
// BFloat16); C: the cache's (T, or an 8-bit code with its scales ksc, vsc [blocks, KVH]; nullptr: none). Everything is
// widened to fp32 in registers, so the arithmetic is fp32 either way. DC: head_dim known at compile time (0: use D).
// With a sliding window (W > 0) only the last W keys count, and only the blocks that hold them are read; with a
// soft cap (cap > 0) each score s becomes cap * tanh(s / cap) before the softmax (Gemma 2).
template <typename T, typename C, int DC>
static void decode_one(T* ob_t, const T* qb_t, const C* kp, const C* vp, const float* ksc, const float* vsc, int64_t KVH, const int64_t* table, int64_t L,
                       int64_t H, int64_t G, int64_t Dr, int64_t bs, int64_t kb, int64_t kt, int64_t kh,
                       int64_t vb, int64_t vt, int64_t vh, float sc, std::vector<float>& s, std::vector<float>& qo,
                       int64_t h0, int64_t h1, int64_t W, float cap, bool touch) {
  const int64_t D = DC ? DC : Dr, nblk = (L + bs - 1) / bs;
  const int64_t L0 = W > 0 ? std::max<int64_t>(0, L - W) : 0, i0 = L0 / bs, ls = i0 * bs;   // the first key seen, its block
  // blocks lie anywhere in the pool, which defeats the hardware prefetcher. Hints alone did not help (with a fresh page
  // a block, a hint that misses the TLB goes unserved): every line of the sequence's K and V blocks is first read in
  // one loop of independent loads, which keeps many misses in flight, and the hints then lift each block from L2 to
  // L1 ahead of its use. SmolLM2's heads, 32 rows of 150-300 keys, 30 layers' caches in turn (a step's pattern): 611
  // -> 393 us a call with AVX2, 519 -> 367 with AVX-512; a cache already in L3 pays the loop (383 -> 412 us)
  const int64_t kbytes = bs * kt * (int64_t)sizeof(C), vbytes = bs * vt * (int64_t)sizeof(C);
  auto prefetch = [&](const C* base, int64_t stride, int64_t bytes, int64_t i) {
    if (i >= nblk) return;
    const char* p = (const char*)(base + table[i] * stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  };
  if (touch) {
    unsigned acc = 0;
    for (int64_t i = i0; i < nblk; ++i) {
      const char *pk = (const char*)(kp + table[i] * kb), *pv = (const char*)(vp + table[i] * vb);
      for (int64_t off = 0; off < kbytes || off < vbytes; off += 64) acc += (off < kbytes ? pk[off] : 0) + (off < vbytes ? pv[off] : 0);
    }
    static thread_local volatile unsigned sink; sink = acc;     // the loads must happen: their sum goes somewhere
  }
  // block i's scale for KV head g, times the code's unit (1 for plain caches)
  auto bscale = [&](const float* sc_, int64_t i, int64_t g) { return sc_ ? sc_[table[i] * KVH + g] * unit<C>() : 1.f; };
  s.resize(H * L); qo.resize(2 * H * D);
  float* qb = qo.data(); float* ob = qb + H * D;    // the query and the output row in fp32
  for (int64_t i = h0 * D; i < h1 * D; ++i) qb[i] = static_cast<float>(qb_t[i]);
  prefetch(kp, kb, kbytes, i0); prefetch(kp, kb, kbytes, i0 + 1);
  for (int64_t i = i0; i < nblk; ++i) {           // scores: every head against each key row of block i
    prefetch(kp, kb, kbytes, i + 2);
    const C* blk = kp + table[i] * kb;
    const int64_t l0 = i * bs, n = std::min(bs, L - l0);
#if defined(__AVX512F__) || defined(LLM_AVX2)
    if constexpr (vector_path<C, DC>()) {
      constexpr int NC = DC / VEC_LANES;
      head_runs<NC>(h0, h1, G, [&](int64_t h, int64_t nh) {
        NH_SWITCH(nh, scores_group, qb + h * D, D, blk + (h / G) * kh, kt, n, s.data() + h * L + l0, L, sc * bscale(ksc, i, h / G))
      });
      continue;
    }
#endif
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = qb + h * D; const C* kk = blk + (h / G) * kh;
      const float sch = sc * bscale(ksc, i, h / G);
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {               // four independent dot products at a time
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        const C *k0 = kk + t * kt, *k1 = k0 + kt, *k2 = k1 + kt, *k3 = k2 + kt;
        #pragma omp simd reduction(+:a0,a1,a2,a3)
        for (int64_t d = 0; d < D; ++d) {
          const float x = qh[d];
          a0 += x * widen(k0[d]); a1 += x * widen(k1[d]);
          a2 += x * widen(k2[d]); a3 += x * widen(k3[d]);
        }
        float* sh = s.data() + h * L + l0 + t;
        sh[0] = a0 * sch; sh[1] = a1 * sch; sh[2] = a2 * sch; sh[3] = a3 * sch;
      }
      for (; t < n; ++t) {
        float a = 0.f; const C* k0 = kk + t * kt;
        #pragma omp simd reduction(+:a)
        for (int64_t d = 0; d < D; ++d) a += qh[d] * widen(k0[d]);
        s[h * L + l0 + t] = a * sch;
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) {            // softmax per head, over the keys seen (the rest of their first block: 0)
    float* sh = s.data() + h * L; float m = -INFINITY, sum = 0.f;
    if (cap > 0.f) for (int64_t l = L0; l < L; ++l) sh[l] = cap * std::tanh(sh[l] / cap);
    for (int64_t l = L0; l < L; ++l) m = std::max(m, sh[l]);
    for (int64_t l = ls; l < L0; ++l) sh[l] = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t l = L0; l < L; ++l) { sh[l] = std::exp(sh[l] - m); sum += sh[l]; }
    const float inv = 1.f / sum;
    for (int64_t l = L0; l < L; ++l) sh[l] *= inv;
  }
  std::fill(ob + h0 * D, ob + h1 * D, 0.f);      // weighted sum of the value rows, block by block
  prefetch(vp, vb, vbytes, i0); prefetch(vp, vb, vbytes, i0 + 1);
  for (int64_t i = i0; i < nblk; ++i) {
    prefetch(vp, vb, vbytes, i + 2);
    const C* blk = vp + table[i] * vb;
    const int64_t l0 = i * bs, n = std::min(bs, L - l0);
#if defined(__AVX512F__) || defined(LLM_AVX2)
    if constexpr (vector_path<C, DC>()) {
      constexpr int NC = DC / VEC_LANES;
      head_runs<NC>(h0, h1, G, [&](int64_t h, int64_t nh) {
        NH_SWITCH(nh, values_group, s.data() + h * L + l0, L, blk + (h / G) * vh, vt, n, ob + h * D, D, bscale(vsc, i, h / G))
      });
      continue;
    }
#endif
    for (int64_t h = h0; h < h1; ++h) {
      float acc[DC ? DC : 1024];                  // this head's output row, kept in registers when DC is known
      float* o = ob + h * D; const C* vv = blk + (h / G) * vh; const float* p = s.data() + h * L + l0;
      const float vs = bscale(vsc, i, h / G);
      for (int64_t d = 0; d < D; ++d) acc[d] = o[d];
      for (int64_t t = 0; t < n; ++t) {
        const float w = p[t] * vs; const C* vt_ = vv + t * vt;
        #pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += w * widen(vt_[d]);
      }
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
    }
  }
  for (int64_t i = h0 * D; i < h1 * D; ++i) ob_t[i] = static_cast<T>(ob[i]);
}

template <typename T, typename C>
static void decode_all(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const float* ksc, const float* vsc, const int64_t* btp, const int64_t* clp, int64_t W, float sc, int64_t win, float cap) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), bs = k_cache.size(1), G = H / k_cache.size(2);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const T* qp = q.data_ptr<T>(); T* op = out.data_ptr<T>();
  const C *kp = static_cast<const C*>(k_cache.data_ptr()), *vp = static_cast<const C*>(v_cache.data_ptr());
  const int64_t KVH = k_cache.size(2);
  const int64_t threads = at::get_num_threads(), NT = std::max<int64_t>(1, std::min<int64_t>(threads, B));
  auto one = D == 64 ? decode_one<T, C, 64> : D == 128 ? decode_one<T, C, 128> : decode_one<T, C, 0>;
  if (B < threads && H > 1) {     // fewer rows than threads (batch 1): each thread takes a share of every row's heads
    const int64_t P = std::min<int64_t>(H, (threads + B - 1) / B);
    at::parallel_for(0, B * P, 1, [&](int64_t u0, int64_t u1) {
      std::vector<float> s, qo;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / P, part = u % P;
        one(op + b * H * D, qp + b * H * D, kp, vp, ksc, vsc, KVH, btp + b * W, clp[b], H, G, D, bs, kb, kt, kh, vb, vt, vh, sc, s, qo,
            part * H / P, (part + 1) * H / P, win, cap, false);
      }
    });
    return;
  }
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s, qo;
    for (int64_t tid = t0; tid < t1; ++tid)
      for (int64_t b = tid; b < B; b += NT)          // round robin, as rows arrive sorted by length
        one(op + b * H * D, qp + b * H * D, kp, vp, ksc, vsc, KVH, btp + b * W, clp[b], H, G, D, bs, kb, kt, kh, vb, vt, vh, sc, s, qo, 0, H, win, cap, true);
  });
}

// the checks both ops share; returns the block tables and lengths made contiguous
static std::pair<at::Tensor, at::Tensor> check_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                      const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && q.sizes() == out.sizes(), "q, out: contiguous [B, H, D]");
  const auto st = q.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kBFloat16) && out.scalar_type() == st, "q and out: both fp32 or both bf16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.size(3) == q.size(2) &&
              v_cache.sizes() == k_cache.sizes(), "caches: [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables and lengths");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && block_tables.size(0) == B && context_lens.size(0) == B && D <= 1024, "shapes disagree");
  auto bt = block_tables.contiguous(); auto cl = context_lens.contiguous();
  const int64_t *btp = bt.data_ptr<int64_t>(), *clp = cl.data_ptr<int64_t>(), W = bt.size(1);
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(clp[b] >= 1 && clp[b] <= W * bs, "context length outside its block table");
  for (int64_t i = 0; i < bt.numel(); ++i) TORCH_CHECK(btp[i] >= 0 && btp[i] < k_cache.size(0), "block table entry outside the cache");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap: 0 (none) or positive");
  return {bt, cl};
}

// out[b, h] = softmax(scale * q[b, h] . K_b) V_b, where K_b, V_b are read in place through block_tables[b]
// (the last `window` keys only where window > 0; scores soft-capped where softcap > 0)
static void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  auto [bt, cl] = check_decode(out, q, k_cache, v_cache, block_tables, context_lens, window, softcap);
  const auto st = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == st && v_cache.scalar_type() == st, "q, out and the caches: all fp32 or all bf16");
  const int64_t *btp = bt.data_ptr<int64_t>(), *clp = cl.data_ptr<int64_t>(), W = bt.size(1);
  if (st == at::kFloat) decode_all<float, float>(out, q, k_cache, v_cache, nullptr, nullptr, btp, clp, W, (float)scale, window, (float)softcap);
  else decode_all<at::BFloat16, at::BFloat16>(out, q, k_cache, v_cache, nullptr, nullptr, btp, clp, W, (float)scale, window, (float)softcap);
}

// the same over an 8-bit cache: int8 codes, or fp8 e4m3 codes held as uint8, with fp32 scales [blocks, kv_heads]
static void paged_decode_q8(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  auto [bt, cl] = check_decode(out, q, k_cache, v_cache, block_tables, context_lens, window, softcap);
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((ct == at::kChar || ct == at::kByte) && v_cache.scalar_type() == ct, "8-bit caches: int8 codes, or fp8 e4m3 codes as uint8");
  for (const auto& s : {k_scales, v_scales})
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == k_cache.size(0) &&
                s.size(1) == k_cache.size(2), "scales: contiguous fp32 [blocks, kv_heads]");
  const float *ksc = k_scales.data_ptr<float>(), *vsc = v_scales.data_ptr<float>();
  const int64_t *btp = bt.data_ptr<int64_t>(), *clp = cl.data_ptr<int64_t>(), W = bt.size(1);
  const float sc = (float)scale, cap = (float)softcap;
  if (q.scalar_type() == at::kFloat) {
    if (ct == at::kChar) decode_all<float, int8_t>(out, q, k_cache, v_cache, ksc, vsc, btp, clp, W, sc, window, cap);
    else decode_all<float, fp8e4m3>(out, q, k_cache, v_cache, ksc, vsc, btp, clp, W, sc, window, cap);
  } else {
    if (ct == at::kChar) decode_all<at::BFloat16, int8_t>(out, q, k_cache, v_cache, ksc, vsc, btp, clp, W, sc, window, cap);
    else decode_all<at::BFloat16, fp8e4m3>(out, q, k_cache, v_cache, ksc, vsc, btp, clp, W, sc, window, cap);
  }
}

// Storing into an 8-bit cache (notebook 03's QuantizedKV.store, in one call): the rows of one step arrive in runs that
// share a block (a sequence's tokens are contiguous in the flat batch). Per run and KV head: the scale its rows need;
// a run that writes its block's first slot starts the block afresh; where the block's scale must grow, the rows
// already in it are re-encoded at the new one; then the run's rows are encoded.
// the largest code of each format: notebook 03's KV_CODES holds the same two numbers, and its tests hold them equal
template <typename C> constexpr float max_code();
template <> constexpr float max_code<int8_t>() { return 127.f; }
template <> constexpr float max_code<fp8e4m3>() { return 448.f; }
static inline int8_t encode_code(float v, int8_t*) { return static_cast<int8_t>(std::max(-max_code<int8_t>(), std::min(max_code<int8_t>(), std::nearbyint(v)))); }
static inline fp8e4m3 encode_code(float v, fp8e4m3*) { return fp8e4m3{c10::Float8_e4m3fn(std::max(-max_code<fp8e4m3>(), std::min(max_code<fp8e4m3>(), v))).x}; }
template <typename C> static inline float code_value(C c) { return widen(c) * unit<C>(); }

template <typename T, typename C>
static void store_runs(const T* x, C* codes, float* scales, const int64_t* slots, int64_t n, int64_t bs, int64_t H, int64_t D) {
  constexpr float qmax = max_code<C>();
  std::vector<float> need(H);
  for (int64_t a = 0; a < n;) {
    const int64_t blk = slots[a] / bs;
    int64_t e = a + 1;
    bool fresh = slots[a] % bs == 0;
    for (; e < n && slots[e] / bs == blk; ++e) fresh |= slots[e] % bs == 0;
    float* sc = scales + blk * H; C* cb = codes + blk * bs * H * D;
    std::fill(need.begin(), need.end(), 0.f);
    for (int64_t t = a; t < e; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const T* xs = x + (t * H + h) * D; float m = need[h];
        #pragma omp simd reduction(max:m)
        for (int64_t d = 0; d < D; ++d) m = std::max(m, std::abs(static_cast<float>(xs[d])));
        need[h] = m;
      }
    for (int64_t h = 0; h < H; ++h) {
      const float old = fresh ? 0.f : sc[h], nw = std::max({old, need[h] / qmax, 1e-30f});
      if (nw > old && old > 0.f)
        for (int64_t r = 0; r < bs; ++r)
          for (int64_t d = 0; d < D; ++d) { C& c = cb[(r * H + h) * D + d]; c = encode_code(code_value(c) * old / nw, &c); }
      sc[h] = nw;
    }
    for (int64_t t = a; t < e; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.f / sc[h]; const T* xs = x + (t * H + h) * D; C* cs = codes + (slots[t] * H + h) * D;
        #pragma omp simd
        for (int64_t d = 0; d < D; ++d) cs[d] = encode_code(static_cast<float>(xs[d]) * inv, cs + d);
      }
    a = e;
  }
}

static void store_q8(const at::Tensor& x, at::Tensor codes, at::Tensor scales, const at::Tensor& slot_mapping) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "x: contiguous fp32 or bf16 [T, kv_heads, D]");
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte) &&
              codes.size(2) == x.size(1) && codes.size(3) == x.size(2), "codes: contiguous int8 or fp8-as-uint8 [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == codes.size(0) &&
              scales.size(1) == codes.size(2), "scales: contiguous fp32 [blocks, kv_heads]");
  auto sl = slot_mapping.contiguous();
  TORCH_CHECK(sl.scalar_type() == at::kLong && sl.numel() == x.size(0), "slot_mapping: int64, one per row");
  const int64_t n = x.size(0), bs = codes.size(1), H = codes.size(2), D = codes.size(3), *slp = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slp[i] >= 0 && slp[i] < codes.size(0) * bs, "slot outside the cache");
  float* scp = scales.data_ptr<float>();
  auto run = [&](auto* xp) {
    if (codes.scalar_type() == at::kChar) store_runs(xp, static_cast<int8_t*>(codes.data_ptr()), scp, slp, n, bs, H, D);
    else store_runs(xp, static_cast<fp8e4m3*>(codes.data_ptr()), scp, slp, n, bs, H, D);
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>()); else run(x.data_ptr<at::BFloat16>());
}

TORCH_LIBRARY(llm_engine, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window=0, float softcap=0.0) -> ()");
  m.def("paged_decode_q8(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scales, Tensor v_scales, "
        "Tensor block_tables, Tensor context_lens, float scale, int window=0, float softcap=0.0) -> ()");
  m.def("store_q8(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor slot_mapping) -> ()");
}
TORCH_LIBRARY_IMPL(llm_engine, CPU, m) { m.impl("paged_decode", paged_decode); m.impl("paged_decode_q8", paged_decode_q8); m.impl("store_q8", store_q8); }
