// Dequant-matmul for XLA:CPU: y = x @ dequantize(w) for one PackedWeight, the
// weight unpacked in registers and never written out (see
// pallas_kernels/dequant_matmul/native.py for the contract). The formula is
// formats.py's, w = s * (q - z) - l with s = d * sc and l = mn * m, a factor a
// format lacks left out. Over the 16 rows of `in` that a group covers at least
// (k-quants' sub-blocks; every other group is a multiple of 32), s, z and l
// are constant per column, so
//
//   sum_k x[k] w[k] = s * sum_k x[k] q[k] - (s * z + l) * sum_k x[k]
//
// The inner loop is the first sum only: codes shifted out of their bit planes,
// converted to float and multiplied into float32 accumulators, one FMA per
// code and row of x. Each 32-row run then adds s times its sums (one per half
// run) to the output rows and subtracts the offset times the sums of x, which
// are computed once per call.
//
// Work items are taken from one atomic counter by the calling thread and all
// but one of XLA's CPU pool threads (as many workers as cores). Usually they
// are blocks of output columns, each running up to kMaxRows rows of x at a
// time over all of `in` with its accumulators in registers (Pass). A lone row
// of x whose plane rows are short (single-stream decode) reads them whole, one
// after another, instead, and its items are ranges of runs (Stream): reading
// a run's rows side by side streams from memory at a third of the rate. With
// int8 activations a lone row's items are chunks of columns, each walked run
// by run (PassQ8Lone), with the sums of its row in a batch.
//
// With int8 activations (attribute int8_x) each row of x is first rounded to
// int8 codes with one float32 scale per 32 values (llama.cpp's Q8_0 for
// activations), and the inner loop is an integer dot: four plane rows are
// transposed so that each 32-bit lane holds four codes of one column along
// `in`, and one VNNI instruction (vpdpbusd: unsigned weight codes times signed
// activation codes) adds 64 products where the float loop adds 16 (PassQ8).
// Each group's integer sums (a half run for k-quants, else a run) are scaled
// once per group and row. A work item first copies its block of plane rows,
// four rows at a time, transposed as the passes read them, and the passes
// read the copy.
//
// The weight may be a stack of layers ([layers, ...] on every array) with the
// layer chosen by an operand, so that the decoder's layer scan passes the
// whole stack and no per-layer slice is copied.
//
// DequantMatmulGroup takes several weights of one format with the same x (a
// layer's q, k and v): x is rounded once, and the work items of all of them
// go through one counter, so the pool wakes once per group.
//
// The file is one translation unit, or several that compile in parallel and
// link into one library (pallas_kernels/native: PARTS): NATIVE_PART=0 is the
// handler with everything but the passes, and NATIVE_PART=b0*16+b1 the passes
// of one bit layout (MakePasses's explicit instance), nine tenths of the
// compile time between them.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#if !defined(NATIVE_PART) || NATIVE_PART == 0
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
#endif

// Named, not anonymous: the parts share these types and MakePasses's instances.
namespace dequant_matmul {

// Floats per vector: one register of the instruction set built for (GCC
// expands a wider generic vector one piece at a time, through memory: 16-lane
// vectors ran 10x slower than XLA's dot on AVX2).
#if defined(__AVX512F__)
constexpr int kLanes = 16;  // AVX-512
#elif defined(__AVX2__)
constexpr int kLanes = 8;   // AVX2
#else
constexpr int kLanes = 4;   // SSE2, NEON
#endif
constexpr int kRun = 32;      // codes per packed run along `in`
constexpr int kHalf = 16;     // the finest group the kernel reads (k-quants' sub-blocks)
constexpr int kMaxBlock = 1024;  // output columns per work item at most
constexpr int kMaxRows = 8;   // rows of x per pass at most
constexpr int kRowBlock = kMaxRows;  // rows of x side by side in the int8 layout
constexpr int kQuads = kRun / 4;     // int8 codes of x four to an int32
constexpr int kArrays = 5;    // the group arrays d, sc, z, mn, m
// A lone row of x streams plane rows of up to kStreamRowBytes (a page: longer
// rows live in pages of their own, which the column blocks read well), in
// chunks of kStreamCols columns (32 KB of sums).
constexpr int64_t kStreamRowBytes = 4096;
constexpr int64_t kStreamCols = 8192;
// Work (rows of `in` x columns x (rows of x + 2)) from which a call is spread
// over the thread pool; below it, the calling thread runs it alone.
constexpr int64_t kParallelWork = int64_t{1} << 21;
constexpr int kSpins = 20000;  // pause loops (~50 us) before the calling thread sleeps
// RunItem's copy of a block prefetches the plane rows this far ahead of the
// four it transposes (into L2: prefetcht1).
constexpr int64_t kCopyAhead = 16;
// PassQ8Lone prefetches the plane rows of the run this many runs ahead of the
// one it multiplies (into L2: prefetcht1).
constexpr int64_t kLoneAhead = 2;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint8_t U8x16 __attribute__((vector_size(kLanes)));
typedef int8_t I8x16 __attribute__((vector_size(kLanes)));
typedef uint32_t UVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Vec Splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(_mm512_set1_ps(x));
#else
  return x - Vec{};  // exact for every x, so it folds to a broadcast
#endif
}


inline Vec ToFloat(IVec v) { return __builtin_convertvector(v, Vec); }


// Widening loads of kLanes bytes. GCC lowers __builtin_convertvector of bytes
// one lane at a time, so AVX-512 and AVX2 get their instructions.
inline IVec LoadU8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<IVec>(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<IVec>(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  U8x16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, IVec);
#endif
}

inline Vec LoadI8(const int8_t* p) {
#if defined(__AVX512F__)
  return ToFloat(reinterpret_cast<IVec>(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return ToFloat(reinterpret_cast<IVec>(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  I8x16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, Vec);
#endif
}

// float16 bits -> float32 (normal, subnormal, zero, inf and NaN).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline Vec LoadF16(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__AVX2__) && defined(__F16C__)
  return reinterpret_cast<Vec>(
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = HalfToFloat(p[i]);
  Vec v;
  std::memcpy(&v, lanes, sizeof v);
  return v;
#endif
}

inline void Pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// One [K, N] matrix of a PackedWeight (one layer of a stack).
struct Weight {
  int64_t k = 0, n = 0;
  int b0 = 0, b1 = 0;  // bits of plane 0 (the code's low bits) and plane 1 (0: none)
  const uint8_t* p0 = nullptr;
  const uint8_t* p1 = nullptr;
  const uint16_t* d = nullptr;  // float16 bits
  const int8_t* sc = nullptr;
  const uint8_t* z = nullptr;
  const uint16_t* mn = nullptr;
  const uint8_t* m = nullptr;
  int64_t gd = 0, gs = 0, gz = 0, gmn = 0, gm = 0;  // rows of `in` per group row
  // Per half run h: where the group rows of d, sc, z, mn and m holding row
  // h * kHalf start (row * n), so that no pass divides.
  const int64_t* starts = nullptr;  // [k / kHalf, kArrays]
  int zero = 0;          // the zero code when z is absent (or one value for the matrix)
  // PassQ8 reads the bytes of plane rows 4q .. 4q + 3 at column c as one lane
  // (Gather4's layout) at p0 + (q * pn + (c - pc)) * 4, in RunItem's copy of
  // an item's block of columns (pn: its width, pc: its first column).
  int64_t pn = 0, pc = 0;
  int64_t fine = 0;      // the finest group: kHalf or a multiple of kRun
  bool offset = false;   // whether s * z + l can be nonzero
};

struct Problem {
  Weight w;
  const float* x = nullptr;   // [rows, k]
  const float* xs = nullptr;  // [rows, k / kHalf]: sums of x over each half run
  // int8 activations, in blocks of kRowBlock rows (QuantizeRows): x's codes four
  // to an int32 (codes 4t .. 4t + 3 of a run), each run's scale, and the sums of
  // the rounded x over each half run and each run.
  const int32_t* xq = nullptr;  // [row blocks][runs][kRun / 4][kRowBlock]
  const float* xd = nullptr;    // [row blocks][runs][kRowBlock]
  const float* xh = nullptr;    // [row blocks][halves][kRowBlock]
  const float* xr = nullptr;    // [row blocks][runs][kRowBlock]
  // With 8-bit codes where PassQ8 multiplies them with DotWide (kWidePairs): each
  // int32 of xq as its Int16Pairs.
  const int32_t* xw = nullptr;  // [row blocks][runs][kRun / 4][kRowBlock][2]
  float* y = nullptr;         // [rows, n]
  int64_t rows = 0;
  int64_t block = 0;  // output columns per work item
  // One row of x with short plane rows: items are ranges of runs (see Stream),
  // item i > 0 summing into partials[i - 1] (each [vector_end]).
  bool stream = false;
  int64_t item_runs = 0;
  int64_t vector_end = 0;  // columns in whole vectors
  float* partials = nullptr;
  // A lone row of x with int8 activations: items are chunks of `block`
  // columns, each over every run in order (PassQ8Lone).
  bool lone_q8 = false;
};

// The group rows of d, sc, z, mn and m that hold one half run (nullptr where
// the weight lacks the array).
struct GroupRows {
  const uint16_t* d;
  const int8_t* sc;
  const uint8_t* z;
  const uint16_t* mn;
  const uint8_t* m;
};

inline GroupRows RowsOf(const Weight& w, int64_t half) {
  const int64_t* at = w.starts + half * kArrays;
  return GroupRows{w.d + at[0], w.sc ? w.sc + at[1] : nullptr, w.z ? w.z + at[2] : nullptr,
                   w.mn ? w.mn + at[3] : nullptr, w.m ? w.m + at[4] : nullptr};
}

// Prefetches (into L2) the 64 columns from `c` of a half run's group arrays.
inline void PrefetchGroups(const GroupRows& g, int64_t c) {
  __builtin_prefetch(g.d + c, 0, 2);
  __builtin_prefetch(g.d + c + 32, 0, 2);
  if (g.sc) __builtin_prefetch(g.sc + c, 0, 2);
  if (g.z) __builtin_prefetch(g.z + c, 0, 2);
  if (g.mn) {
    __builtin_prefetch(g.mn + c, 0, 2);
    __builtin_prefetch(g.mn + c + 32, 0, 2);
  }
  if (g.m) __builtin_prefetch(g.m + c, 0, 2);
}

// s and s * z + l of one vector of columns from `c` of a half run's group.
__attribute__((always_inline)) inline void Factors(const Weight& w, const GroupRows& g, int64_t c,
                                                   Vec& s, Vec& o) {
  s = LoadF16(g.d + c);
  if (g.sc) s *= LoadI8(g.sc + c);
  o = Vec{};
  if (g.z) {
    o = ToFloat(LoadU8(g.z + c)) * s;
  } else if (w.zero) {
    o = s * static_cast<float>(w.zero);
  }
  if (g.mn) o += g.m ? LoadF16(g.mn + c) * ToFloat(LoadU8(g.m + c)) : LoadF16(g.mn + c);
}

// Bits [shift, shift + width) of every lane's byte (constants once unrolled).
inline IVec Field(IVec bytes, int shift, int width) {
  const IVec shifted = shift ? bytes >> shift : bytes;
  return shift + width == 8 ? shifted : shifted & ((1 << width) - 1);
}

// y[r0 : r0 + Rows, col : end] = x[r0 : r0 + Rows] @ dequantize(w)[:, col : end]
// for whole vectors of columns. Runs are the outer loop and the columns the
// inner one, so the block's bytes of each plane row are read in address order
// (every 4 * b rows of a run are that many sequential streams); the output
// rows live in `out` [Rows, end - col] meanwhile. B0 and B1 are the bit planes'
// widths (B1 = 0: one plane); byte j of a plane's run holds codes j + s * 4 * b
// at bit s * b. Fine: the groups are half runs (16 rows), each with its own
// sums; else a run's codes share one sum per row. With few rows the sums are
// split over kChains accumulators so that the FMAs' latency is hidden.
template <int B0, int B1, int Rows, bool Fine>
void Pass(const Problem& p, int64_t col, int64_t end, int64_t r0, float* __restrict out) {
  constexpr int kRows0 = 4 * B0, kRows1 = B1 ? 4 * B1 : 1;
  constexpr int kHalves = Fine ? 2 : 1;
  constexpr int kChains = Rows * kHalves >= 8 ? 1 : 8 / (Rows * kHalves);
  const Weight& w = p.w;
  const int64_t width = end - col, halves = w.k / kHalf;
  const float* x = p.x + r0 * w.k;
  const float* xs = p.xs + r0 * halves;
  std::fill(out, out + Rows * width, 0.0f);
  for (int64_t run = 0; run < w.k / kRun; ++run) {
    const int64_t row = run * kRun;
    const GroupRows g0 = RowsOf(w, 2 * run), g1 = RowsOf(w, 2 * run + 1);
    for (int64_t c = 0; c < width; c += kLanes) {
      Vec s[2], o[2];
      Factors(w, g0, col + c, s[0], o[0]);
      if constexpr (Fine) Factors(w, g1, col + c, s[1], o[1]);
      IVec hi[kRows1];
      if constexpr (B1 != 0) {
#pragma GCC unroll 16
        for (int j = 0; j < kRows1; ++j)
          hi[j] = LoadU8(w.p1 + (run * kRows1 + j) * w.n + col + c);
      }
      Vec acc[kHalves][kChains][Rows];
      for (int h = 0; h < kHalves; ++h)
        for (int k = 0; k < kChains; ++k)
          for (int r = 0; r < Rows; ++r) acc[h][k][r] = Vec{};
      // Plane 0 row by row, each byte's codes used at once (few registers held).
#pragma GCC unroll 32
      for (int j = 0; j < kRows0; ++j) {
        const IVec bytes = LoadU8(w.p0 + (run * kRows0 + j) * w.n + col + c);
#pragma GCC unroll 4
        for (int f = 0; f < 8 / B0; ++f) {
          const int i = j + f * kRows0;
          IVec q = Field(bytes, f * B0, B0);
          if constexpr (B1 != 0) q |= Field(hi[i % kRows1], (i / kRows1) * B1, B1) << B0;
          const Vec qf = ToFloat(q);
#pragma GCC unroll 16
          for (int r = 0; r < Rows; ++r)
            acc[Fine ? i / kHalf : 0][i % kChains][r] += Splat(x[r * w.k + row + i]) * qf;
        }
      }
      for (int r = 0; r < Rows; ++r) {
        Vec a[kHalves];
        for (int h = 0; h < kHalves; ++h) {
          a[h] = acc[h][0][r];
          for (int k = 1; k < kChains; ++k) a[h] += acc[h][k][r];
        }
        const float x0 = xs[r * halves + 2 * run], x1 = xs[r * halves + 2 * run + 1];
        float* dst = out + r * width + c;
        Vec y = Load(dst);
        if constexpr (Fine) {
          y += a[0] * s[0] + a[1] * s[1];
          if (w.offset) y -= o[0] * x0 + o[1] * x1;
        } else {
          y += a[0] * s[0];
          if (w.offset) y -= o[0] * (x0 + x1);
        }
        Store(dst, y);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    std::memcpy(p.y + (r0 + r) * w.n + col, out + r * width, sizeof(float) * width);
}

// Four plane rows (row, row + stride, ...) at kLanes columns, transposed so
// that byte t of lane c is row t's byte of column c.
inline UVec Gather4(const uint8_t* row, int64_t stride) {
#if defined(__AVX512VBMI__)
  alignas(64) static const uint8_t kTranspose[64] = {
      0,  16, 32, 48, 1,  17, 33, 49, 2,  18, 34, 50, 3,  19, 35, 51,
      4,  20, 36, 52, 5,  21, 37, 53, 6,  22, 38, 54, 7,  23, 39, 55,
      8,  24, 40, 56, 9,  25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + stride)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * stride)),
                         2);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 3 * stride)),
                         3);
  return reinterpret_cast<UVec>(_mm512_permutexvar_epi8(_mm512_load_si512(kTranspose), v));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  // Eight columns of each row, interleaved bytewise (rows 0/1 and 2/3), then
  // pairwise: columns 0-3 in the low half, 4-7 in the high half.
  const __m128i r0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row));
  const __m128i r1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + stride));
  const __m128i r2 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 * stride));
  const __m128i r3 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 3 * stride));
  const __m128i a = _mm_unpacklo_epi8(r0, r1), b = _mm_unpacklo_epi8(r2, r3);
  return reinterpret_cast<UVec>(
      _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b)));
#else
  const UVec b0 = reinterpret_cast<UVec>(LoadU8(row));
  const UVec b1 = reinterpret_cast<UVec>(LoadU8(row + stride));
  const UVec b2 = reinterpret_cast<UVec>(LoadU8(row + 2 * stride));
  const UVec b3 = reinterpret_cast<UVec>(LoadU8(row + 3 * stride));
  return b0 | b1 << 8 | b2 << 16 | b3 << 24;
#endif
}

// Gather4 of plane rows row .. row + 3 (row a multiple of 4) at column c, read
// from RunItem's copy of an item's block, which holds them transposed already.
inline UVec CopiedQuad(const Weight& w, const uint8_t* plane, int64_t row, int64_t c) {
  UVec v;
  std::memcpy(&v, plane + ((row / 4) * w.pn + (c - w.pc)) * 4, sizeof v);
  return v;
}

// Bits [shift, shift + width) of each of a lane's four bytes.
inline UVec FieldBytes(UVec v, int shift, int width) {
  if (shift == 0 && width == 8) return v;
  const uint32_t mask = ((1u << width) - 1) * 0x01010101u;
  return (shift ? v >> shift : v) & mask;
}

// x's four int8 codes as two int32s of sign-extended int16 pairs: codes 0 and
// 2, then codes 1 and 3 (vpmaddwd's operands for even and odd bytes).
inline void Int16Pairs(int32_t x, int32_t pairs[2]) {
  const auto code = [x](int t) {
    return static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int8_t>(x >> (8 * t))));
  };
  pairs[0] = static_cast<int32_t>(code(0) | code(2) << 16);
  pairs[1] = static_cast<int32_t>(code(1) | code(3) << 16);
}

// acc + the sums, per lane, of its four unsigned bytes of w times the four
// signed bytes of x. Wide: codes of 8 bits (else at most 7, so that a
// saturating 16-bit pair sum, 2 * 127 * 127, cannot overflow).
//   AVX-512 VNNI, AVX-VNNI: one vpdpbusd.
//   AVX-512BW, AVX2: vpmaddubsw (pairs to int16) and vpmaddwd by ones (to
//     int32); wide codes instead split into even and odd bytes as int16 and
//     two vpmaddwd with x's even and odd codes, which cannot saturate.
//   NEON with dotprod: sdot on the codes as signed bytes (wide codes offset
//     by 128, added back as 128 times the sum of x's four codes).
//   Otherwise four multiply-adds per lane.
template <bool Wide>
inline IVec Dot4(IVec acc, UVec w, int32_t x) {
#if defined(__AVX512VNNI__) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
#if defined(__AVX512VNNI__)
  return reinterpret_cast<IVec>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc),
                                                    reinterpret_cast<__m512i>(w),
                                                    _mm512_set1_epi32(x)));
#else
  return reinterpret_cast<IVec>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc),
                                                        reinterpret_cast<__m256i>(w),
                                                        _mm256_set1_epi32(x)));
#endif
#elif defined(__AVX512BW__) || defined(__AVX2__)
#if defined(__AVX512BW__)
#define DOT4_OP(name) _mm512_##name
  typedef __m512i Reg;
#else
#define DOT4_OP(name) _mm256_##name
  typedef __m256i Reg;
#endif
  Reg sum;
  if constexpr (Wide) {
    int32_t pairs[2];
    Int16Pairs(x, pairs);
    const Reg even = DOT4_OP(madd_epi16)(reinterpret_cast<Reg>(w & 0x00ff00ffu),
                                         DOT4_OP(set1_epi32)(pairs[0]));
    const Reg odd = DOT4_OP(madd_epi16)(reinterpret_cast<Reg>((w >> 8) & 0x00ff00ffu),
                                        DOT4_OP(set1_epi32)(pairs[1]));
    sum = DOT4_OP(add_epi32)(even, odd);
  } else {
    sum = DOT4_OP(madd_epi16)(DOT4_OP(maddubs_epi16)(reinterpret_cast<Reg>(w), DOT4_OP(set1_epi32)(x)),
                              DOT4_OP(set1_epi16)(1));
  }
#undef DOT4_OP
  return acc + reinterpret_cast<IVec>(sum);
#elif defined(__ARM_FEATURE_DOTPROD)
  const int8x16_t xs = vreinterpretq_s8_s32(vdupq_n_s32(x));
  if constexpr (Wide) {
    const int32_t total = static_cast<int8_t>(x) + static_cast<int8_t>(x >> 8) +
                          static_cast<int8_t>(x >> 16) + static_cast<int8_t>(x >> 24);
    const int8x16_t ws = vreinterpretq_s8_u32(veorq_u32(reinterpret_cast<uint32x4_t>(w),
                                                        vdupq_n_u32(0x80808080u)));
    return reinterpret_cast<IVec>(vdotq_s32(reinterpret_cast<int32x4_t>(acc), ws, xs)) +
           128 * total;
  } else {
    return reinterpret_cast<IVec>(vdotq_s32(reinterpret_cast<int32x4_t>(acc),
                                            vreinterpretq_s8_u32(reinterpret_cast<uint32x4_t>(w)),
                                            xs));
  }
#else
  for (int t = 0; t < 4; ++t) {
    const IVec wt = reinterpret_cast<IVec>((w >> (8 * t)) & 0xffu);
    acc += wt * static_cast<int32_t>(static_cast<int8_t>(x >> (8 * t)));
  }
  return acc;
#endif
}

// AVX2 and AVX-512BW without VNNI (DQM_PAIR_SUMS), the passes of several rows
// use two forms that Dot4 does not, with the same integer sums:
// - PairSum/Widen: vpmaddubsw's pair sums of a group's codes add up as int16
//   (vpaddw) and widen to int32 once per group (vpmaddwd by ones), where the
//   group's pair sums cannot overflow int16 (PairSums): codes of at most `bits`
//   bits times x's codes (|x| <= 127) give pair sums of at most
//   2 * (2^bits - 1) * 127. Dot4 widens every four codes: two of the
//   shuffle-port instructions per four codes against one.
// - DotWide: codes of 8 bits, which Dot4 takes apart into even and odd bytes,
//   multiply x's codes already made int16 pairs (Problem.xw) instead of pairs
//   built per code.
#if (defined(__AVX512BW__) || defined(__AVX2__)) && !defined(__AVX512VNNI__) && \
    !defined(__AVXVNNI__)
#define DQM_PAIR_SUMS 1
constexpr bool kWidePairs = true;
#if defined(__AVX512BW__)
#define PAIR_OP(name) _mm512_##name
typedef __m512i PairReg;
#else
#define PAIR_OP(name) _mm256_##name
typedef __m256i PairReg;
#endif

// acc (int16 lanes) + vpmaddubsw of w's four codes per lane and x's four.
inline IVec PairSum(IVec acc, UVec w, int32_t x) {
  const PairReg sum = PAIR_OP(maddubs_epi16)(reinterpret_cast<PairReg>(w), PAIR_OP(set1_epi32)(x));
  return reinterpret_cast<IVec>(PAIR_OP(add_epi16)(reinterpret_cast<PairReg>(acc), sum));
}

// The int32 sums of acc's int16 lane pairs.
inline IVec Widen(IVec acc) {
  return reinterpret_cast<IVec>(
      PAIR_OP(madd_epi16)(reinterpret_cast<PairReg>(acc), PAIR_OP(set1_epi16)(1)));
}

// acc + w's 8-bit codes times x's four codes, given as int16 pairs x2[0] (codes
// 0 and 2) and x2[1] (codes 1 and 3).
inline IVec DotWide(IVec acc, UVec w, const int32_t* x2) {
  const PairReg even = PAIR_OP(madd_epi16)(reinterpret_cast<PairReg>(w & 0x00ff00ffu),
                                           PAIR_OP(set1_epi32)(x2[0]));
  const PairReg odd = PAIR_OP(madd_epi16)(reinterpret_cast<PairReg>((w >> 8) & 0x00ff00ffu),
                                          PAIR_OP(set1_epi32)(x2[1]));
  return acc + reinterpret_cast<IVec>(even) + reinterpret_cast<IVec>(odd);
}
#undef PAIR_OP
#else
constexpr bool kWidePairs = false;
#endif

// Whether groups of `quads` quads of `bits`-bit codes sum as int16 pairs.
constexpr bool PairSums([[maybe_unused]] int bits, [[maybe_unused]] int quads) {
#if defined(DQM_PAIR_SUMS)
  return bits < 8 && quads * 2 * ((1 << bits) - 1) * 127 <= 32767;
#else
  return false;
#endif
}

// Where row r0's int8 codes, run scales and half-run/run sums start in the
// layout of QuantizeRows (a pass's rows lie in one block of kRowBlock: r0 is a
// multiple of the pass's row count).
struct RowsQ8 {
  const int32_t* xq;
  const float *xd, *xh, *xr;
  const int32_t* xw;  // nullptr without Problem.xw
};

inline RowsQ8 RowsQ8At(const Problem& p, int64_t r0) {
  const int64_t halves = p.w.k / kHalf, runs = p.w.k / kRun;
  const int64_t block = r0 / kRowBlock, lane = r0 % kRowBlock;
  return {p.xq + block * runs * kQuads * kRowBlock + lane,
          p.xd + block * runs * kRowBlock + lane, p.xh + block * halves * kRowBlock + lane,
          p.xr + block * runs * kRowBlock + lane,
          p.xw ? p.xw + (block * runs * kQuads * kRowBlock + lane) * 2 : nullptr};
}

// Pass with int8 activations. The columns are the outer loop here, so that
// the Rows output vectors stay in registers over all runs; within a run the
// codes go in order, four at a time in each lane (four plane rows transposed
// by Gather4, each plane row read once per run), into one integer dot per row
// that is scaled into the outputs at the end of each group (half run or run).
template <int B0, int B1, int Rows, bool Fine>
void PassQ8(const Problem& p, int64_t col, int64_t end, int64_t r0, float* __restrict) {
  constexpr int kRows0 = 4 * B0, kRows1 = B1 ? 4 * B1 : 1;
  constexpr int kGroup = Fine ? kHalf : kRun;  // codes per integer dot
  [[maybe_unused]] constexpr bool kPairs = PairSums(B0 + B1, kGroup / 4);
  const Weight& w = p.w;
  const int64_t runs = w.k / kRun;
  const RowsQ8 x = RowsQ8At(p, r0);
  const int32_t* xq = x.xq;
  const float *xd = x.xd, *xh = x.xh, *xr = x.xr;
  [[maybe_unused]] const int32_t* xw = x.xw;
  for (int64_t c = col; c < end; c += kLanes) {
    Vec y[Rows];
    for (int r = 0; r < Rows; ++r) y[r] = Vec{};
    for (int64_t run = 0; run < runs; ++run) {
      UVec hi[B1 ? B1 : 1];
      if constexpr (B1 != 0) {
        for (int u = 0; u < B1; ++u) hi[u] = CopiedQuad(w, w.p1, run * kRows1 + 4 * u, c);
      }
      UVec bytes[B0];
      IVec acc[Rows];
#pragma GCC unroll 8
      for (int i = 0; i < kRun; i += 4) {  // codes i .. i + 3 of the run
        const int j = i % kRows0, f = i / kRows0;
        if (f == 0) bytes[j / 4] = CopiedQuad(w, w.p0, run * kRows0 + j, c);
        UVec q = FieldBytes(bytes[j / 4], f * B0, B0);
        if constexpr (B1 != 0) q |= FieldBytes(hi[(i % kRows1) / 4], (i / kRows1) * B1, B1) << B0;
        if (i % kGroup == 0)
          for (int r = 0; r < Rows; ++r) acc[r] = IVec{};
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const int32_t x4 = xq[(run * kQuads + i / 4) * kRowBlock + r];
#if defined(DQM_PAIR_SUMS)
          if constexpr (kPairs) {
            acc[r] = PairSum(acc[r], q, x4);
            continue;
          }
          if constexpr (B0 + B1 >= 8 && kWidePairs) {
            acc[r] = DotWide(acc[r], q, xw + ((run * kQuads + i / 4) * kRowBlock + r) * 2);
            continue;
          }
#endif
          acc[r] = Dot4<(B0 + B1 >= 8)>(acc[r], q, x4);
        }
        if ((i + 4) % kGroup == 0) {  // the group's last codes: scale its dots into y
          const int half = 2 * run + i / kHalf;
          Vec s, o;
          Factors(w, RowsOf(w, half), c, s, o);
          for (int r = 0; r < Rows; ++r) {
            IVec dots = acc[r];
#if defined(DQM_PAIR_SUMS)
            if constexpr (kPairs) dots = Widen(dots);
#endif
            y[r] += ToFloat(dots) * Splat(xd[run * kRowBlock + r]) * s;
            if (w.offset)
              y[r] -= o * Splat(Fine ? xh[half * kRowBlock + r] : xr[run * kRowBlock + r]);
          }
        }
      }
    }
    for (int r = 0; r < Rows; ++r) Store(p.y + (r0 + r) * w.n + c, y[r]);
  }
}

#if defined(DQM_PAIR_SUMS)
// PassQ8 for 8-bit codes (one plane) where they go through DotWide. Eight rows
// of PassQ8 keep 16 vectors of sums and outputs in registers, all AVX2 has,
// and GCC unpacked a whole run's codes ahead of the dots besides, spilling to
// the stack; here the outputs live in `out` (Rows vectors) and the codes go
// one quad at a time. The integer dots and the float operations on y are
// PassQ8's, in its order, so the results are the same bits.
template <int Rows, bool Fine>
void PassQ8Wide(const Problem& p, int64_t col, int64_t end, int64_t r0, float* __restrict out) {
  constexpr int kGroup = Fine ? kHalf : kRun;
  const Weight& w = p.w;
  const int64_t runs = w.k / kRun;
  const RowsQ8 x = RowsQ8At(p, r0);
  for (int64_t c = col; c < end; c += kLanes) {
    for (int r = 0; r < Rows; ++r) Store(out + r * kLanes, Vec{});
    for (int64_t run = 0; run < runs; ++run) {
      for (int g = 0; g < kRun; g += kGroup) {
        IVec acc[Rows];
        for (int r = 0; r < Rows; ++r) acc[r] = IVec{};
#pragma GCC unroll 1
        for (int i = g; i < g + kGroup; i += 4) {
          const UVec q = CopiedQuad(w, w.p0, run * kRun + i, c);
          const int32_t* xw = x.xw + (run * kQuads + i / 4) * kRowBlock * 2;
#pragma GCC unroll 8
          for (int r = 0; r < Rows; ++r) acc[r] = DotWide(acc[r], q, xw + r * 2);
        }
        const int half = 2 * run + g / kHalf;
        Vec s, o;
        Factors(w, RowsOf(w, half), c, s, o);
        for (int r = 0; r < Rows; ++r) {
          Vec y = Load(out + r * kLanes);
          y += ToFloat(acc[r]) * Splat(x.xd[run * kRowBlock + r]) * s;
          if (w.offset)
            y -= o * Splat(Fine ? x.xh[half * kRowBlock + r] : x.xr[run * kRowBlock + r]);
          Store(out + r * kLanes, y);
        }
      }
    }
    for (int r = 0; r < Rows; ++r) Store(p.y + (r0 + r) * w.n + c, Load(out + r * kLanes));
  }
}
#endif

// PassQ8, or PassQ8Wide where it applies.
template <int B0, int B1, int Rows, bool Fine>
void PassQ8For(const Problem& p, int64_t col, int64_t end, int64_t r0, float* __restrict out) {
#if defined(DQM_PAIR_SUMS)
  if constexpr (B0 == 8 && B1 == 0) {
    PassQ8Wide<Rows, Fine>(p, col, end, r0, out);
    return;
  }
#endif
  PassQ8<B0, B1, Rows, Fine>(p, col, end, r0, out);
}

// PassQ8 for one row of x (the last row of a batch that leaves one; a lone
// row of a call goes through PassQ8Lone), kWide column vectors at a time: each plane row's
// reads are then whole 64-byte lines (4 x 16 bytes on AVX-512), and the
// independent dots of the vectors overlap. Columns past the last kWide
// vectors go through PassQ8. (PassQ8 with the column vectors as one more
// template dimension computed the same and ran a one-sequence step at 6.8 ms
// against this function's 5.9 ms, so one row keeps its own loop.)
constexpr int kWide = 4;

template <int B0, int B1, bool Fine>
void PassQ8One(const Problem& p, int64_t col, int64_t end, int64_t r0, float* __restrict out) {
  constexpr int kRows0 = 4 * B0, kRows1 = B1 ? 4 * B1 : 1;
  constexpr int kGroup = Fine ? kHalf : kRun;
  const Weight& w = p.w;
  const int64_t runs = w.k / kRun;
  const RowsQ8 x = RowsQ8At(p, r0);
  const int32_t* xq = x.xq;
  const float *xd = x.xd, *xh = x.xh, *xr = x.xr;
  const int64_t wide_end = col + (end - col) / (kWide * kLanes) * (kWide * kLanes);
  for (int64_t c = col; c < wide_end; c += kWide * kLanes) {
    Vec y[kWide];
    for (int u = 0; u < kWide; ++u) y[u] = Vec{};
    for (int64_t run = 0; run < runs; ++run) {
      UVec hi[kWide][B1 ? B1 : 1];
      if constexpr (B1 != 0) {
        for (int u = 0; u < kWide; ++u)
          for (int v = 0; v < B1; ++v)
            hi[u][v] = CopiedQuad(w, w.p1, run * kRows1 + 4 * v, c + u * kLanes);
      }
      UVec bytes[kWide][B0];
      IVec acc[kWide];
#pragma GCC unroll 8
      for (int i = 0; i < kRun; i += 4) {
        const int j = i % kRows0, f = i / kRows0;
        if (i % kGroup == 0)
          for (int u = 0; u < kWide; ++u) acc[u] = IVec{};
        const int32_t x4 = xq[(run * kQuads + i / 4) * kRowBlock];
#pragma GCC unroll 4
        for (int u = 0; u < kWide; ++u) {
          if (f == 0)
            bytes[u][j / 4] = CopiedQuad(w, w.p0, run * kRows0 + j, c + u * kLanes);
          UVec q = FieldBytes(bytes[u][j / 4], f * B0, B0);
          if constexpr (B1 != 0)
            q |= FieldBytes(hi[u][(i % kRows1) / 4], (i / kRows1) * B1, B1) << B0;
          acc[u] = Dot4<(B0 + B1 >= 8)>(acc[u], q, x4);
        }
        if ((i + 4) % kGroup == 0) {
          const int half = 2 * run + i / kHalf;
          const GroupRows g = RowsOf(w, half);
          const Vec xs = Splat(xd[run * kRowBlock]);
          const Vec xo = Splat(Fine ? xh[half * kRowBlock] : xr[run * kRowBlock]);
          for (int u = 0; u < kWide; ++u) {
            Vec s, o;
            Factors(w, g, c + u * kLanes, s, o);
            y[u] += ToFloat(acc[u]) * xs * s;
            if (w.offset) y[u] -= o * xo;
          }
        }
      }
    }
    for (int u = 0; u < kWide; ++u) Store(p.y + r0 * w.n + c + u * kLanes, y[u]);
  }
  if (wide_end < end) PassQ8<B0, B1, 1, Fine>(p, wide_end, end, r0, out);
}

// A lone row of x with int8 activations (decode of one sequence), columns
// [c0, c1) of whole vectors: the runs are the outer loop and the columns the
// inner one, as in Pass, so that each plane row of a run is read in address
// order across the chunk, and y lives in memory meanwhile. PassQ8One (the
// columns outside, four vectors' sums in registers) reads one 64-byte line of
// every plane row of the matrix before the next line of any: over an LM head's
// rows, 49,152 bytes apart, that ran at a third of this order's rate (one
// SmolLM2 Q8_0 head: 4.3 against 1.4 ms), and 1.2x slower on its 1,536-column
// projections. Each group's integer dot and y's operations are PassQ8One's, in
// its order, so a lone row's outputs are bit-equal to its row's in a batch.
// A chunk's stretch of each plane row in a run is a few lines, too short for
// the hardware prefetchers: on a Zen 4 the loads stalled on memory (a
// one-sequence step 10.8 ms), so the pass prefetches the plane rows and group
// arrays of the run kLoneAhead ahead, a line of each per 64 columns (6.8 ms).
template <int B0, int B1>
void PassQ8Lone(const Problem& p, int64_t c0, int64_t c1) {
  constexpr int kRows0 = 4 * B0, kRows1 = B1 ? 4 * B1 : 1;
  const Weight& w = p.w;
  const bool fine = w.fine < kRun;
  const int64_t runs = w.k / kRun;
  const RowsQ8 x = RowsQ8At(p, 0);
  std::fill(p.y + c0, p.y + c1, 0.0f);
  for (int64_t run = 0; run < runs; ++run) {
    int32_t x4[kQuads];
    for (int t = 0; t < kQuads; ++t) x4[t] = x.xq[(run * kQuads + t) * kRowBlock];
    const Vec xs = Splat(x.xd[run * kRowBlock]);
    const GroupRows g0 = RowsOf(w, 2 * run), g1 = RowsOf(w, 2 * run + 1);
    const Vec xo0 = Splat(fine ? x.xh[2 * run * kRowBlock] : x.xr[run * kRowBlock]);
    const Vec xo1 = Splat(fine ? x.xh[(2 * run + 1) * kRowBlock] : 0.0f);
    const uint8_t* rows0 = w.p0 + run * kRows0 * w.n;
    const uint8_t* rows1 = B1 ? w.p1 + run * kRows1 * w.n : nullptr;
    const bool ahead = run + kLoneAhead < runs;
    const GroupRows n0 = ahead ? RowsOf(w, 2 * (run + kLoneAhead)) : g0;
    const GroupRows n1 = ahead ? RowsOf(w, 2 * (run + kLoneAhead) + 1) : g1;
    for (int64_t c = c0; c < c1; c += kLanes) {
      if (ahead && (c - c0) % 64 == 0) {  // a new line of each plane row: the later run's too
        for (int r = 0; r < kRows0; ++r)
          __builtin_prefetch(rows0 + (kLoneAhead * kRows0 + r) * w.n + c, 0, 2);
        if constexpr (B1 != 0)
          for (int r = 0; r < kRows1; ++r)
            __builtin_prefetch(rows1 + (kLoneAhead * kRows1 + r) * w.n + c, 0, 2);
        PrefetchGroups(n0, c);
        PrefetchGroups(n1, c);
      }
      UVec hi[B1 ? B1 : 1];
      if constexpr (B1 != 0)
        for (int v = 0; v < B1; ++v) hi[v] = Gather4(rows1 + 4 * v * w.n + c, w.n);
      UVec bytes[B0];
      IVec acc0 = IVec{}, acc1 = IVec{};
#pragma GCC unroll 8
      for (int i = 0; i < kRun; i += 4) {
        const int j = i % kRows0, f = i / kRows0;
        if (f == 0) bytes[j / 4] = Gather4(rows0 + j * w.n + c, w.n);
        UVec q = FieldBytes(bytes[j / 4], f * B0, B0);
        if constexpr (B1 != 0) q |= FieldBytes(hi[(i % kRows1) / 4], (i / kRows1) * B1, B1) << B0;
        if (i < kHalf) {
          acc0 = Dot4<(B0 + B1 >= 8)>(acc0, q, x4[i / 4]);
        } else {
          acc1 = Dot4<(B0 + B1 >= 8)>(acc1, q, x4[i / 4]);
        }
      }
      Vec s, o, y = Load(p.y + c);
      if (fine) {
        Factors(w, g0, c, s, o);
        y += ToFloat(acc0) * xs * s;
        if (w.offset) y -= o * xo0;
        Factors(w, g1, c, s, o);
        y += ToFloat(acc1) * xs * s;
        if (w.offset) y -= o * xo1;
      } else {
        Factors(w, g1, c, s, o);
        y += ToFloat(acc0 + acc1) * xs * s;
        if (w.offset) y -= o * xo0;
      }
      Store(p.y + c, y);
    }
  }
}

using PassFn = void (*)(const Problem&, int64_t, int64_t, int64_t, float*);
using LoneFn = void (*)(const Problem&, int64_t, int64_t);

// The passes of one bit layout by rows of x (1, 2, 4, 8), for groups of half
// runs and of whole runs: a call runs the largest that fits its rows left (16
// rows in one pass spilled registers and ran at 60% of two passes of 8).
struct Passes {
  PassFn fine[4];
  PassFn whole[4];
  PassFn fine_q8[4];  // int8 activations
  PassFn whole_q8[4];
  LoneFn lone_q8;  // a lone row with int8 activations
};

template <int B0, int B1>
Passes MakePasses() {
  return Passes{{Pass<B0, B1, 1, true>, Pass<B0, B1, 2, true>, Pass<B0, B1, 4, true>,
                 Pass<B0, B1, 8, true>},
                {Pass<B0, B1, 1, false>, Pass<B0, B1, 2, false>, Pass<B0, B1, 4, false>,
                 Pass<B0, B1, 8, false>},
                {PassQ8One<B0, B1, true>, PassQ8For<B0, B1, 2, true>, PassQ8For<B0, B1, 4, true>,
                 PassQ8For<B0, B1, 8, true>},
                {PassQ8One<B0, B1, false>, PassQ8For<B0, B1, 2, false>,
                 PassQ8For<B0, B1, 4, false>, PassQ8For<B0, B1, 8, false>},
                PassQ8Lone<B0, B1>};
}

// Every bit layout the kernel takes.
#define DQM_LAYOUTS(X) X(8, 0) X(4, 2) X(4, 1) X(4, 0) X(2, 1) X(2, 0)

#if defined(NATIVE_PART) && NATIVE_PART != 0
template Passes MakePasses<NATIVE_PART / 16, NATIVE_PART % 16>();
}  // namespace dequant_matmul
#else
#if defined(NATIVE_PART)
#define DQM_EXTERN(b0, b1) extern template Passes MakePasses<b0, b1>();
DQM_LAYOUTS(DQM_EXTERN)
#endif

// The passes for planes of b0 and b1 bits (b1 = 0: one plane), or nullptr.
const Passes* PassesFor(int b0, int b1) {
  static const Passes p8 = MakePasses<8, 0>(), p42 = MakePasses<4, 2>(), p41 = MakePasses<4, 1>(),
                      p4 = MakePasses<4, 0>(), p21 = MakePasses<2, 1>(), p2 = MakePasses<2, 0>();
  switch (b0 * 16 + b1) {
    case 8 * 16: return &p8;
    case 4 * 16 + 2: return &p42;
    case 4 * 16 + 1: return &p41;
    case 4 * 16: return &p4;
    case 2 * 16 + 1: return &p21;
    case 2 * 16: return &p2;
    default: return nullptr;
  }
}

// One row of x: the plane rows of `plane` (B bits, its code bits from Shift
// up) for run `run`, columns [c0, c1), each row read whole and in address
// order, added into per-column sums: `acc0` for the run's first half and `acc1`
// for its second (the same array when the groups cover whole runs).
template <int B, int Shift>
void StreamPlane(const uint8_t* plane, int64_t n, int64_t run, const float* x, int64_t c0,
                 int64_t c1, float* __restrict acc0, float* __restrict acc1) {
  constexpr int kPlaneRows = 4 * B, kFields = 8 / B;
  for (int j = 0; j < kPlaneRows; ++j) {
    const uint8_t* src = plane + (run * kPlaneRows + j) * n;
    Vec xv[kFields];
    for (int f = 0; f < kFields; ++f) xv[f] = Splat(x[j + f * kPlaneRows] * float(1 << Shift));
    if constexpr (kFields == 1) {
      float* dst = j < kHalf ? acc0 : acc1;  // 8-bit codes: row j is code j
      for (int64_t c = c0; c < c1; c += kLanes)
        Store(dst + c, Load(dst + c) + xv[0] * ToFloat(LoadU8(src + c)));
    } else {
      // Fields below kFields / 2 are codes of the first half run, the rest of the second.
      for (int64_t c = c0; c < c1; c += kLanes) {
        const IVec bytes = LoadU8(src + c);
        Vec t0 = Vec{}, t1 = Vec{};
#pragma GCC unroll 8
        for (int f = 0; f < kFields; ++f) {
          const Vec q = ToFloat(Field(bytes, f * B, B));
          if (f < kFields / 2) {
            t0 += xv[f] * q;
          } else {
            t1 += xv[f] * q;
          }
        }
        if (acc0 == acc1) {
          Store(acc0 + c, Load(acc0 + c) + (t0 + t1));
        } else {
          Store(acc0 + c, Load(acc0 + c) + t0);
          Store(acc1 + c, Load(acc1 + c) + t1);
        }
      }
    }
  }
}

// One row of x (decode of a lone sequence), runs [run0, run1) and columns
// [c0, c1) of whole vectors, into out[c0 : c1]. The Pass order reads a run's
// 4 * b plane rows side by side, 16 bytes of each at a time, which streams
// from memory at a third of the rate of reading one row after another; here
// each plane row is read whole (its codes' products summed per column in L1),
// at the price of a load and a store of those sums per row.
template <int B0, int B1>
void StreamChunk(const Problem& p, int64_t run0, int64_t run1, int64_t c0, int64_t c1,
                 float* __restrict out, float* __restrict acc) {
  const Weight& w = p.w;
  const int64_t width = c1 - c0;
  const bool fine = w.fine < kRun;
  float* acc0 = acc - c0;  // indexed by column
  float* acc1 = fine ? acc0 + width : acc0;
  std::fill(out + c0, out + c1, 0.0f);
  for (int64_t run = run0; run < run1; ++run) {
    const int64_t row = run * kRun;
    std::fill(acc, acc + (fine ? 2 : 1) * width, 0.0f);
    StreamPlane<B0, 0>(w.p0, w.n, run, p.x + row, c0, c1, acc0, acc1);
    if constexpr (B1 != 0) StreamPlane<B1, B0>(w.p1, w.n, run, p.x + row, c0, c1, acc0, acc1);
    const GroupRows g0 = RowsOf(w, 2 * run), g1 = RowsOf(w, 2 * run + 1);
    const float x0 = p.xs[2 * run], x1 = p.xs[2 * run + 1];
    for (int64_t c = c0; c < c1; c += kLanes) {
      Vec s0, o0, y = Load(out + c);
      Factors(w, g0, c, s0, o0);
      if (fine) {
        Vec s1, o1;
        Factors(w, g1, c, s1, o1);
        y += Load(acc0 + c) * s0 + Load(acc1 + c) * s1;
        if (w.offset) y -= o0 * x0 + o1 * x1;
      } else {
        y += Load(acc0 + c) * s0;
        if (w.offset) y -= o0 * (x0 + x1);
      }
      Store(out + c, y);
    }
  }
}

// Stream's columns in chunks of at most kStreamCols, so that the per-column
// sums stay in L1 however wide the weight (an LM head).
template <int B0, int B1>
void Stream(const Problem& p, int64_t run0, int64_t run1, int64_t c0, int64_t c1,
            float* __restrict out, float* __restrict acc) {
  for (int64_t c = c0; c < c1; c += kStreamCols)
    StreamChunk<B0, B1>(p, run0, run1, c, std::min(c1, c + kStreamCols), out, acc);
}

using StreamFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, float*, float*);

StreamFn StreamFor(int b0, int b1) {
  switch (b0 * 16 + b1) {
    case 8 * 16: return Stream<8, 0>;
    case 4 * 16 + 2: return Stream<4, 2>;
    case 4 * 16 + 1: return Stream<4, 1>;
    case 4 * 16: return Stream<4, 0>;
    case 2 * 16 + 1: return Stream<2, 1>;
    case 2 * 16: return Stream<2, 0>;
    default: return nullptr;
  }
}

// Element (r, i) of x as rounded to int8 (its code times its run's scale).
float RoundedX(const Problem& p, int64_t r, int64_t i) {
  const int64_t runs = p.w.k / kRun, block = r / kRowBlock, lane = r % kRowBlock;
  const int64_t run = i / kRun, quad = (i % kRun) / 4;
  const int32_t four = p.xq[((block * runs + run) * kQuads + quad) * kRowBlock + lane];
  const int8_t code = static_cast<int8_t>(four >> (8 * (i % 4)));
  return code * p.xd[(block * runs + run) * kRowBlock + lane];
}

// One element of the weight, for the columns past the last whole vector.
float Element(const Weight& w, int64_t row, int64_t col) {
  const int64_t run = row / kRun, i = row % kRun;
  const int rows0 = 4 * w.b0;
  int32_t q = (w.p0[(run * rows0 + i % rows0) * w.n + col] >> ((i / rows0) * w.b0)) &
              ((1 << w.b0) - 1);
  if (w.b1) {
    const int rows1 = 4 * w.b1;
    q |= ((w.p1[(run * rows1 + i % rows1) * w.n + col] >> ((i / rows1) * w.b1)) &
          ((1 << w.b1) - 1))
         << w.b0;
  }
  float s = HalfToFloat(w.d[(row / w.gd) * w.n + col]);
  if (w.sc) s *= static_cast<float>(w.sc[(row / w.gs) * w.n + col]);
  int32_t z = w.zero;
  if (w.z) z = w.z[(row / w.gz) * w.n + col];
  float l = 0.0f;
  if (w.mn) {
    l = HalfToFloat(w.mn[(row / w.gmn) * w.n + col]);
    if (w.m) l *= static_cast<float>(w.m[(row / w.gm) * w.n + col]);
  }
  return static_cast<float>(q - z) * s - l;
}

void TailColumns(const Problem& p, int64_t col, int64_t end) {
  const Weight& w = p.w;
  std::vector<float> column(static_cast<size_t>(w.k));
  for (int64_t c = col; c < end; ++c) {
    for (int64_t i = 0; i < w.k; ++i) column[i] = Element(w, i, c);
    for (int64_t r = 0; r < p.rows; ++r) {
      float sum = 0.0f;
      for (int64_t i = 0; i < w.k; ++i) {
        const float xi = p.xq ? RoundedX(p, r, i) : p.x[r * w.k + i];
        sum += xi * column[i];
      }
      p.y[r * w.n + c] = sum;
    }
  }
}

// Item `item`: runs [item * item_runs, ...) of a streamed call (into y for the
// first, else into its partial sums), or columns [item * block, ...) of every
// row of y.
void RunItem(const Problem& p, int64_t item, std::vector<float>& out) {
  if (p.stream) {
    const int64_t run0 = item * p.item_runs;
    const int64_t run1 = std::min(p.w.k / kRun, run0 + p.item_runs);
    float* dst = item == 0 ? p.y : p.partials + (item - 1) * p.vector_end;
    out.resize(static_cast<size_t>(2 * std::min(p.vector_end, kStreamCols)));
    StreamFor(p.w.b0, p.w.b1)(p, run0, run1, 0, p.vector_end, dst, out.data());
    return;
  }
  const Passes& passes = *PassesFor(p.w.b0, p.w.b1);
  const int64_t col = item * p.block, end = std::min(p.w.n, col + p.block);
  const int64_t vector_end = col + (end - col) / kLanes * kLanes;
  if (p.lone_q8) {
    if (vector_end > col) passes.lone_q8(p, col, vector_end);
    if (vector_end < end) TailColumns(p, vector_end, end);
    return;
  }
  out.resize(static_cast<size_t>(kMaxRows * p.block));
  const bool fine = p.w.fine < kRun;
  // PassQ8 walks the columns outside and the runs inside, reading a line of
  // every plane row before the next line of any: from memory, too many streams
  // for the hardware prefetchers (a 49,152-column LM head ran at a third of its
  // speed from cache). It reads a copy of the block's plane rows instead, made
  // four rows at a time along the block, which also serves every pass after
  // the first. The copy holds each four rows transposed as Gather4 gives them,
  // so a pass loads each lane's four codes at once: with 16 rows of x (two
  // passes) the transposes are done once, not twice. The block's plane rows
  // are short stretches (its width) far apart, which the hardware prefetchers
  // do not run ahead on: read from memory, the copy stalled on each one (a
  // fifth of a 16-sequence step's time on AVX2), so it prefetches the rows
  // kCopyAhead ahead of those it transposes.
  Problem copy;
  const Problem* q = &p;
  if (p.xq && vector_end > col) {
    thread_local std::vector<uint8_t> panel;
    const int64_t width = vector_end - col;
    const int64_t rows0 = p.w.k * p.w.b0 / 8, rows1 = p.w.k * p.w.b1 / 8;
    panel.resize(static_cast<size_t>((rows0 + rows1) * width));
    const auto transpose = [&](const uint8_t* plane, int64_t rows, uint8_t* dst) {
      for (int64_t r = 0; r < rows; r += 4) {
        for (int64_t a = r + kCopyAhead; a < std::min(rows, r + kCopyAhead + 4); ++a) {
          const uint8_t* ahead = plane + a * p.w.n;
          for (int64_t c = col; c < vector_end; c += 64) __builtin_prefetch(ahead + c, 0, 2);
          __builtin_prefetch(ahead + vector_end - 1, 0, 2);
        }
        for (int64_t c = col; c < vector_end; c += kLanes) {
          const UVec v = Gather4(plane + r * p.w.n + c, p.w.n);
          std::memcpy(dst + (r / 4 * width + (c - col)) * 4, &v, sizeof v);
        }
      }
    };
    transpose(p.w.p0, rows0, panel.data());
    transpose(p.w.p1, rows1, panel.data() + rows0 * width);
    copy = p;
    copy.w.p0 = panel.data();
    copy.w.p1 = panel.data() + rows0 * width;
    copy.w.pn = width;
    copy.w.pc = col;
    q = &copy;
  }
  for (int64_t r0 = 0; r0 < p.rows && vector_end > col;) {
    int pick = 3;  // 8 rows
    while ((int64_t{1} << pick) > p.rows - r0) --pick;
    const PassFn* pick_from = p.xq ? (fine ? passes.fine_q8 : passes.whole_q8)
                                   : (fine ? passes.fine : passes.whole);
    pick_from[pick](*q, col, vector_end, r0, out.data());
    r0 += int64_t{1} << pick;
  }
  if (vector_end < end) TailColumns(p, vector_end, end);
}

// Items shared by the calling thread and the pool's tasks. Tasks hold it by
// shared_ptr: one that starts after the call returned finds no item left and
// touches nothing else.
// One call's problems (one per weight; a group call's weights share x and its
// rounding) and their work items, numbered one after another across problems.
struct Work {
  std::vector<Problem> problems;
  std::vector<int64_t> ends;  // problems[j]'s items end before ends[j]
  std::vector<float> xs;
  std::vector<int32_t> xq, xw;
  std::vector<float> xd, xh, xr;
  std::vector<std::vector<int64_t>> starts;   // per problem
  std::vector<std::vector<float>> partials;   // per problem
  int64_t total = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;

  void Run() {
    thread_local std::vector<float> out;
    for (int64_t item = next.fetch_add(1); item < total; item = next.fetch_add(1)) {
      size_t j = 0;
      while (item >= ends[j]) ++j;
      RunItem(problems[j], j == 0 ? item : item - ends[j - 1], out);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

// One run of x (32 values) as int8 codes: d = max |x| / 127 (NaN when the run
// holds an infinity or NaN, so that its outputs are NaN) and q = x / d rounded
// to nearest, ties to even (reference.quantize_activations computes the same
// codes). Returns d; sums gets the codes' sums over each half run.
// The largest |value| of a run, and whether all of its values are finite (the
// largest is exact either way; a scalar loop took 20 ns a run, most of the
// rounding's time).
inline float RunAmax(const float* src, bool& finite) {
#if defined(__AVX512F__)
  const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(src));
  const __m512 a1 = _mm512_abs_ps(_mm512_loadu_ps(src + 16));
  const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
  finite = (_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) ==
           0xffff;
  return _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
#elif defined(__AVX2__)
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 m = _mm256_setzero_ps();
  int ok = 0xff;
  for (int u = 0; u < 4; ++u) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(src + 8 * u), abs_mask);
    ok &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for inf and NaN
    m = _mm256_max_ps(m, a);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  finite = ok == 0xff;
  return _mm_cvtss_f32(h);
#elif defined(__ARM_NEON)
  const float32x4_t big = vdupq_n_f32(std::numeric_limits<float>::max());
  float32x4_t m = vdupq_n_f32(0.0f);
  uint32x4_t ok = vdupq_n_u32(~0u);
  for (int u = 0; u < 8; ++u) {
    const float32x4_t a = vabsq_f32(vld1q_f32(src + 4 * u));
    ok = vandq_u32(ok, vcleq_f32(a, big));  // false for inf and NaN
    m = vmaxq_f32(m, a);
  }
  finite = vminvq_u32(ok) != 0;
  return vmaxvq_f32(m);
#else
  float amax = 0.0f;
  finite = true;
  for (int i = 0; i < kRun; ++i) {
    amax = std::max(amax, std::fabs(src[i]));
    finite = finite && std::isfinite(src[i]);
  }
  return amax;
#endif
}

float QuantizeRun(const float* src, int8_t* dst, int32_t sums[2]) {
  bool finite = true;
  const float amax = RunAmax(src, finite);
  const float d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
  sums[0] = sums[1] = 0;
  if (!(d > 0.0f)) {
    std::fill(dst, dst + kRun, 0);
    return d;
  }
#if defined(__AVX512F__)
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_div_ps(_mm512_loadu_ps(src + h * kHalf), _mm512_set1_ps(d));
    const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvtps_epi32(
        _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), r)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + h * kHalf), _mm512_cvtepi32_epi8(q));
    sums[h] = _mm512_reduce_add_epi32(q);
  }
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    __m256i q[2];
    for (int u = 0; u < 2; ++u) {
      const __m256 v = _mm256_div_ps(_mm256_loadu_ps(src + h * kHalf + 8 * u), _mm256_set1_ps(d));
      const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[u] = _mm256_cvtps_epi32(
          _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), r)));
    }
    // int32 to int16 packs per 128-bit lane (q0 0-3, q1 0-3, q0 4-7, q1 4-7): put the
    // halves in order, then pack to int8.
    const __m256i pairs = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + h * kHalf),
                     _mm_packs_epi16(_mm256_castsi256_si128(pairs),
                                     _mm256_extracti128_si256(pairs, 1)));
    const __m256i both = _mm256_add_epi32(q[0], q[1]);
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    sum = _mm_hadd_epi32(sum, sum);
    sums[h] = _mm_cvtsi128_si32(_mm_hadd_epi32(sum, sum));
  }
#elif defined(__ARM_NEON)
  for (int h = 0; h < 2; ++h) {
    int32x4_t q[4];
    for (int u = 0; u < 4; ++u) {
      const float32x4_t v = vdivq_f32(vld1q_f32(src + h * kHalf + 4 * u), vdupq_n_f32(d));
      const float32x4_t r = vrndnq_f32(v);  // to nearest, ties to even
      q[u] = vcvtq_s32_f32(vminq_f32(vdupq_n_f32(127.0f), vmaxq_f32(vdupq_n_f32(-127.0f), r)));
    }
    const int16x8_t lo = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1]));
    const int16x8_t hi = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
    vst1q_s8(dst + h * kHalf, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
    sums[h] = vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
  }
#else
  for (int i = 0; i < kRun; ++i) {
    const float v = std::nearbyint(src[i] / d);
    const int32_t q = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
    dst[i] = static_cast<int8_t>(q);
    sums[i / kHalf] += q;
  }
#endif
  return d;
}

// Rows of x as int8 codes with one scale per run (QuantizeRun), laid out for
// PassQ8 (see Problem): blocks of kRowBlock rows, each run's codes four to an
// int32 with the block's rows side by side, so that a pass reads the rows'
// codes for the same four columns of `in` from one place.
void QuantizeRows(const float* x, int64_t rows, int64_t k, bool wide_pairs, Work& work) {
  const int64_t runs = k / kRun, halves = k / kHalf;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  work.xq.assign(static_cast<size_t>(blocks * runs * kQuads * kRowBlock), 0);
  work.xd.assign(static_cast<size_t>(blocks * runs * kRowBlock), 0.0f);
  work.xh.assign(static_cast<size_t>(blocks * halves * kRowBlock), 0.0f);
  work.xr.assign(static_cast<size_t>(blocks * runs * kRowBlock), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t block = r / kRowBlock, lane = r % kRowBlock;
    for (int64_t run = 0; run < runs; ++run) {
      int8_t codes[kRun];
      int32_t sums[2];
      const float d = QuantizeRun(x + r * k + run * kRun, codes, sums);
      const int64_t at = (block * runs + run) * kRowBlock + lane;
      for (int t = 0; t < kQuads; ++t)
        std::memcpy(&work.xq[(at - lane) * kQuads + t * kRowBlock + lane], codes + 4 * t, 4);
      work.xd[at] = d;
      work.xh[(block * halves + 2 * run) * kRowBlock + lane] = d * static_cast<float>(sums[0]);
      work.xh[(block * halves + 2 * run + 1) * kRowBlock + lane] = d * static_cast<float>(sums[1]);
      work.xr[at] = d * static_cast<float>(sums[0] + sums[1]);
    }
  }
  if (!wide_pairs) return;
  // Problem.xw: each four codes as their Int16Pairs.
  work.xw.resize(work.xq.size() * 2);
  for (size_t i = 0; i < work.xq.size(); ++i) Int16Pairs(work.xq[i], &work.xw[2 * i]);
}

// Rows of `in` per row of a group array with `rows` rows per matrix.
int64_t GroupSize(int64_t k, int64_t rows) { return rows > 0 ? k / rows : 0; }

// One weight's matrix at layer `layer` of its stack, checked against x's
// width `k`; `starts` receives its group rows' offsets (Weight.starts).
ffi::Error LoadWeight(ffi::Buffer<ffi::U8> plane0, ffi::Buffer<ffi::U8> plane1,
                      ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::U8> z,
                      ffi::Buffer<ffi::F16> mn, ffi::Buffer<ffi::U8> m, int64_t layer,
                      int64_t bits0, int64_t bits1, int64_t zero, int64_t k,
                      std::vector<int64_t>& starts, Weight& w) {
  const auto pd = plane0.dimensions();
  if ((pd.size() != 2 && pd.size() != 3) || d.dimensions().size() != pd.size()) {
    return ffi::Error::InvalidArgument(
        "dequant_matmul: x must be [rows, in] and the weight [(layers,) in, out]");
  }
  const int64_t layers = pd.size() == 3 ? pd[0] : 1;
  const int64_t index = pd.size() == 3 ? layer : 0;
  if (index < 0 || index >= layers) {
    return ffi::Error::InvalidArgument("dequant_matmul: layer index out of range");
  }
  w.n = pd[pd.size() - 1];
  w.b0 = static_cast<int>(bits0);
  w.b1 = static_cast<int>(bits1);
  if (PassesFor(w.b0, w.b1) == nullptr) {
    return ffi::Error::InvalidArgument("dequant_matmul: unsupported bit planes");
  }
  w.k = pd[pd.size() - 2] * 8 / w.b0;
  w.zero = static_cast<int>(zero);
  if (k != w.k || w.k % kRun != 0) {
    return ffi::Error::InvalidArgument("dequant_matmul: x's width does not match the weight");
  }
  // A group array's rows per matrix, and its data at the chosen layer.
  auto rows_of = [](auto& buffer) -> int64_t {
    const auto dims = buffer.dimensions();
    return dims.size() >= 2 ? dims[dims.size() - 2] : 0;
  };
  auto at_layer = [&](auto& buffer) {
    return buffer.typed_data() + (buffer.element_count() / layers) * index;
  };
  w.p0 = at_layer(plane0);
  if (w.b1) w.p1 = at_layer(plane1);
  w.d = reinterpret_cast<const uint16_t*>(at_layer(d));
  w.gd = GroupSize(w.k, rows_of(d));
  int64_t fine = w.gd;
  if (sc.element_count() > 0) {
    w.sc = at_layer(sc);
    w.gs = GroupSize(w.k, rows_of(sc));
    fine = std::min(fine, w.gs);
  }
  if (z.element_count() > 0) {
    const auto zd = z.dimensions();
    if (zd[zd.size() - 1] == 1 && zd[zd.size() - 2] == 1) {
      w.zero = at_layer(z)[0];  // one zero code for the whole matrix
    } else {
      w.z = at_layer(z);
      w.gz = GroupSize(w.k, rows_of(z));
      fine = std::min(fine, w.gz);
    }
  }
  if (mn.element_count() > 0) {
    w.mn = reinterpret_cast<const uint16_t*>(at_layer(mn));
    w.gmn = GroupSize(w.k, rows_of(mn));
    fine = std::min(fine, w.gmn);
    if (m.element_count() > 0) {
      w.m = at_layer(m);
      w.gm = GroupSize(w.k, rows_of(m));
      fine = std::min(fine, w.gm);
    }
  }
  w.fine = fine;
  w.offset = w.z != nullptr || w.zero != 0 || w.mn != nullptr;
  if (fine != kHalf && (fine < kRun || fine % kRun != 0)) {
    return ffi::Error::InvalidArgument(
        "dequant_matmul: groups must be 16 rows or a multiple of 32");
  }
  const int64_t halves = w.k / kHalf;
  const int64_t sizes[kArrays] = {w.gd, w.gs, w.gz, w.gmn, w.gm};
  starts.resize(static_cast<size_t>(halves * kArrays));
  for (int64_t h = 0; h < halves; ++h)
    for (int a = 0; a < kArrays; ++a)
      starts[h * kArrays + a] = sizes[a] > 0 ? h * kHalf / sizes[a] * w.n : 0;
  w.starts = starts.data();
  return ffi::Error::Success();
}

// Runs work's problems (their weights and outputs set; every weight `k` wide)
// on x's `rows` rows: x is rounded (int8_x) or summed once for all of them,
// and their items spread over the pool together.
ffi::Error Execute(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t k, bool int8_x,
                   const std::shared_ptr<Work>& work) {
  if (rows == 0) return ffi::Error::Success();
  const int64_t halves = k / kHalf;
  const bool wide_pairs = int8_x && kWidePairs && work->problems[0].w.b0 + work->problems[0].w.b1 >= 8;
  if (int8_x) {
    QuantizeRows(x, rows, k, wide_pairs, *work);
  } else {
    work->xs.resize(static_cast<size_t>(rows * halves));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < halves; ++h) {
        float sum = 0.0f;
        for (int i = 0; i < kHalf; ++i) sum += x[r * k + h * kHalf + i];
        work->xs[r * halves + h] = sum;
      }
    }
  }
  // The calling thread and the pool's threads but one: as many workers as the
  // pool has threads (cores), since the calling thread is not one of them.
  // Handing items to the pool costs tens of microseconds (waking its threads),
  // so a small call runs on the calling thread alone.
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  int64_t size = 0;
  for (const Problem& p : work->problems) size += p.w.k * p.w.n * (rows + 2);
  const bool parallel = workers > 1 && size >= kParallelWork;
  work->partials.resize(work->problems.size());
  for (size_t j = 0; j < work->problems.size(); ++j) {
    Problem& p = work->problems[j];
    const Weight& w = p.w;
    p.x = x;
    p.rows = rows;
    p.xs = work->xs.data();
    if (int8_x) {
      p.xq = work->xq.data();
      p.xw = wide_pairs ? work->xw.data() : nullptr;
      p.xd = work->xd.data();
      p.xh = work->xh.data();
      p.xr = work->xr.data();
    }
    int64_t items = 0;
    // A lone row of x whose plane rows are short reads them one after another
    // (Stream), split over workers by runs; otherwise about four column blocks
    // per worker, of whole vectors, a block of 128 columns or more a multiple of
    // 128 (whole 64-byte lines of 4-bit codes), at most kMaxBlock. Only the
    // split by runs changes the order of a column's sums: it follows the weight's
    // own size, so that a weight gives the same bits alone and in a group.
    p.stream = !int8_x && rows == 1 && w.n * w.b0 / 8 <= kStreamRowBytes;
    if (w.n == 0) {
      items = 0;
    } else if (p.stream) {
      const int64_t runs = w.k / kRun;
      const int64_t parts = workers > 1 && w.k * w.n * 3 >= kParallelWork ? 2 * workers : 1;
      p.vector_end = w.n / kLanes * kLanes;
      p.item_runs = (runs + parts - 1) / parts;
      items = (runs + p.item_runs - 1) / p.item_runs;
      work->partials[j].resize(static_cast<size_t>((items - 1) * p.vector_end));
      p.partials = work->partials[j].data();
    } else if (int8_x && rows == 1) {
      // Two chunks per worker, of whole 64-column stretches, at most kStreamCols.
      const int64_t parts = parallel ? 2 * workers : 1;
      const int64_t chunk = (w.n + parts - 1) / parts;
      p.block = std::min<int64_t>(kStreamCols, (chunk + 63) / 64 * 64);
      p.lone_q8 = true;
      items = (w.n + p.block - 1) / p.block;
    } else {
      int64_t block = (w.n + 4 * workers - 1) / (4 * workers);
      block = block >= 128 ? std::min<int64_t>(kMaxBlock, (block + 127) / 128 * 128)
                           : (block + kLanes - 1) / kLanes * kLanes;
      p.block =
          parallel ? block : std::min<int64_t>(kMaxBlock, (w.n + kLanes - 1) / kLanes * kLanes);
      items = (w.n + p.block - 1) / p.block;
    }
    work->total += items;
    work->ends.push_back(work->total);
  }
  if (work->total == 0) return ffi::Error::Success();
  const int64_t helpers = parallel ? std::min<int64_t>(workers - 1, work->total - 1) : 0;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  // The last items are usually a few microseconds from done: spin before sleeping.
  for (int spin = 0; spin < kSpins && work->done.load() != work->total; ++spin) Pause();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->finished.wait(lock, [&] { return work->done.load() == work->total; });
  for (size_t j = 0; j < work->problems.size(); ++j) {
    Problem& p = work->problems[j];
    if (!p.stream) continue;
    const int64_t items = work->ends[j] - (j == 0 ? 0 : work->ends[j - 1]);
    for (int64_t i = 0; i + 1 < items; ++i) {
      const float* part = p.partials + i * p.vector_end;
      for (int64_t c = 0; c < p.vector_end; ++c) p.y[c] += part[c];
    }
    if (p.vector_end < p.w.n) TailColumns(p, p.vector_end, p.w.n);
  }
  return ffi::Error::Success();
}

ffi::Error DequantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::U8> plane0,
                             ffi::Buffer<ffi::U8> plane1, ffi::Buffer<ffi::F16> d,
                             ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::U8> z,
                             ffi::Buffer<ffi::F16> mn, ffi::Buffer<ffi::U8> m,
                             ffi::ResultBuffer<ffi::F32> y, int64_t bits0, int64_t bits1,
                             int64_t zero, int64_t int8_x) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "dequant_matmul: x must be [rows, in] and the weight [(layers,) in, out]");
  }
  auto work = std::make_shared<Work>();
  work->problems.resize(1);
  work->starts.resize(1);
  Problem& p = work->problems[0];
  const int64_t index = layer.element_count() > 0 ? layer.typed_data()[0] : 0;
  ffi::Error loaded = LoadWeight(plane0, plane1, d, sc, z, mn, m, index, bits0, bits1, zero,
                                 xd[1], work->starts[0], p.w);
  if (loaded.failure()) return loaded;
  p.y = y->typed_data();
  return Execute(pool, x.typed_data(), xd[0], xd[1], int8_x != 0, work);
}

// Several weights of one format (the same bit planes and zero code) times one
// x: each weight's seven arrays in DequantMatmul's order follow x and the layer
// index, and each gives one result [rows, its out]. Projections that share an
// input (a layer's q, k and v; gate and up) go in one call: x is rounded once
// and the pool wakes once for all of them.
ffi::Error DequantMatmulGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                  ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs arrays,
                                  ffi::RemainingRets ys, int64_t bits0, int64_t bits1,
                                  int64_t zero, int64_t int8_x) {
  const auto xd = x.dimensions();
  const size_t count = ys.size();
  if (xd.size() != 2 || count == 0 || arrays.size() != 7 * count) {
    return ffi::Error::InvalidArgument(
        "dequant_matmul_group: x [rows, in], then seven arrays per weight, one result each");
  }
  auto work = std::make_shared<Work>();
  work->problems.resize(count);
  work->starts.resize(count);
  const int64_t index = layer.element_count() > 0 ? layer.typed_data()[0] : 0;
  for (size_t j = 0; j < count; ++j) {
    const size_t a = 7 * j;
    auto plane0 = arrays.get<ffi::Buffer<ffi::U8>>(a);
    auto plane1 = arrays.get<ffi::Buffer<ffi::U8>>(a + 1);
    auto d = arrays.get<ffi::Buffer<ffi::F16>>(a + 2);
    auto sc = arrays.get<ffi::Buffer<ffi::S8>>(a + 3);
    auto z = arrays.get<ffi::Buffer<ffi::U8>>(a + 4);
    auto mn = arrays.get<ffi::Buffer<ffi::F16>>(a + 5);
    auto m = arrays.get<ffi::Buffer<ffi::U8>>(a + 6);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (!plane0.has_value() || !plane1.has_value() || !d.has_value() || !sc.has_value() ||
        !z.has_value() || !mn.has_value() || !m.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("dequant_matmul_group: an array of the wrong type");
    }
    Problem& p = work->problems[j];
    ffi::Error loaded = LoadWeight(*plane0, *plane1, *d, *sc, *z, *mn, *m, index, bits0, bits1,
                                   zero, xd[1], work->starts[j], p.w);
    if (loaded.failure()) return loaded;
    p.y = (*y)->typed_data();
    if (static_cast<int64_t>((*y)->element_count()) != xd[0] * p.w.n) {
      return ffi::Error::InvalidArgument("dequant_matmul_group: a result of the wrong shape");
    }
  }
  return Execute(pool, x.typed_data(), xd[0], xd[1], int8_x != 0, work);
}

}  // namespace dequant_matmul

using dequant_matmul::DequantMatmulGroupImpl;
using dequant_matmul::DequantMatmulImpl;

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantMatmul, DequantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [rows, in]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [] (stacked weights)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // plane 0
                                  .Arg<ffi::Buffer<ffi::U8>>()   // plane 1 ([0]: none)
                                  .Arg<ffi::Buffer<ffi::F16>>()  // d
                                  .Arg<ffi::Buffer<ffi::S8>>()   // sc ([0]: none)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // z ([0]: `zero`)
                                  .Arg<ffi::Buffer<ffi::F16>>()  // mn ([0]: none)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // m ([0]: none)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [rows, out]
                                  .Attr<int64_t>("bits0")
                                  .Attr<int64_t>("bits1")
                                  .Attr<int64_t>("zero")
                                  .Attr<int64_t>("int8_x"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantMatmulGroup, DequantMatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [rows, in]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [] (stacked weights)
                                  .RemainingArgs()  // seven arrays per weight
                                  .RemainingRets()  // y [rows, out] per weight
                                  .Attr<int64_t>("bits0")
                                  .Attr<int64_t>("bits1")
                                  .Attr<int64_t>("zero")
                                  .Attr<int64_t>("int8_x"));
#endif  // the handler's unit
