// Paged attention for XLA:CPU, read straight from the pages. Two handlers
// share everything but how query rows are laid out: PagedAttention takes
// reference.paged_attention's padded [num_seqs, q_len] rows, and
// RaggedPagedAttention reference.ragged_paged_attention's flat run of rows, in
// which sequence s owns rows q_starts[s]:q_starts[s + 1] (decode tokens and
// prefill chunks of several sequences in one call). Both become one list of
// row spans, one per sequence (pallas_kernels/paged_attention/native.py says
// how the operands arrive).
//
// One work item is (sequence, a run of KV heads, a block of query tokens of
// that sequence's span, so a decode row and a long chunk cost what they read). It
// walks the keys any of its queries can see in blocks of kBlock, finds each
// key's row through page_indices inside the whole cache (no gathered copy),
// and keeps a flash-style online softmax in float32 for each query row (one
// row per token and query head; the query heads of one KV head share its K
// and V reads: GQA). Keys a row cannot see (past kv_lens, after its position,
// before its window) are never read for that row, so stale or NaN pages
// cannot reach the output; a row that sees no key returns zeros. Float32 rows
// and unscaled float16 rows of 64 or 128 values are read in place (the float16
// ones widened in registers); other rows are converted to a float32 buffer
// first. (bfloat16 rows read in place were 1.4x faster too, but each in-place
// type and head size adds template instances to a build a first start waits for.) While a block
// is computed, the next block's rows are prefetched: pages are scattered, so
// the hardware prefetcher cannot guess them. Items run on XLA's CPU thread
// pool: the calling thread and the pool's threads take items from one atomic
// counter, and the call returns when every item is done.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Floats per vector: one register of the instruction set built for (GCC
// expands a wider generic vector one piece at a time, through memory).
#if defined(__AVX512F__)
constexpr int kLanes = 16;  // AVX-512
#elif defined(__AVX2__)
constexpr int kLanes = 8;   // AVX2
#else
constexpr int kLanes = 4;   // SSE2, NEON
#endif
constexpr int kBlock = kLanes;  // keys per online-softmax step: one vector of scores
constexpr int64_t kInlineRows = 4096;  // calls reading fewer K rows stay on one thread
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline Vec Splat(float x) { return Vec{} + x; }

// exp(x) for x <= ~88: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to degree 7 (error below 1e-8 relative), 2^n built in the exponent
// bits. Inputs below -87.3 (masked scores) clamp to ~1e-38, never to NaN.
inline Vec Exp(Vec x) {
  const Vec lo = Splat(-87.3f), hi = Splat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const Vec round = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  Vec n = (x * 1.44269504088896341f + round) - round;
  Vec r = x - n * 0.693145751953125f - n * 1.42860682030941723e-06f;
  Vec p = Splat(1.0f / 5040);
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// cap * tanh(x / cap), with tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|).
inline Vec SoftCap(Vec x, float cap) {
  Vec y = x * (1.0f / cap);
  Vec a = y < 0 ? -y : y;
  Vec e = Exp(-2.0f * a);
  Vec t = (1.0f - e) / (1.0f + e);
  return (y < 0 ? -t : t) * cap;
}

float Fp8E4m3fnToFloat(uint8_t x) {
  const int sign = x >> 7, exponent = (x >> 3) & 0xf, mantissa = x & 0x7;
  float value;
  if (exponent == 0xf && mantissa == 0x7) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m / 8 * 2^-6
  } else {
    value = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return sign ? -value : value;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {
    const float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

const float* Fp8Table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = Fp8E4m3fnToFloat(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

// Sixteen e4m3fn values as floats, with integer lane operations only: a normal
// value's exponent and mantissa bits move into a float's and the exponent bias
// grows by 120; a subnormal one is m * 2^-9; 0x7f is NaN (e4m3fn has no inf).
inline Vec Fp8ToFloat(const uint8_t* src) {
#if defined(__AVX512F__)
  IVec x;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m512i widened = _mm512_cvtepu8_epi32(bytes);
  std::memcpy(&x, &widened, sizeof x);
#else
  IVec x;
  for (int i = 0; i < kLanes; ++i) x[i] = src[i];
#endif
  const IVec magnitude = x & 0x7f;
  const IVec bits = (magnitude << 20) + (120 << 23);
  Vec value;
  std::memcpy(&value, &bits, sizeof value);
  const Vec subnormal = __builtin_convertvector(magnitude & 0x7, Vec) * (1.0f / 512);
  value = (magnitude >> 3) == 0 ? subnormal : value;
  value = magnitude == 0x7f ? Splat(std::numeric_limits<float>::quiet_NaN()) : value;
  IVec with_sign;
  std::memcpy(&with_sign, &value, sizeof with_sign);
  with_sign |= (x & 0x80) << 24;
  std::memcpy(&value, &with_sign, sizeof value);
  return value;
}

// How an item reads a cache row's values: float32 (in place, or a row that
// ConvertRow wrote to a buffer), or float16 in place, widened in registers as
// it is loaded (no buffer round trip: a float16 cache reads half the bytes of
// a float32 one, and attention over many sequences is bound by those reads).
enum class Elem { kF32, kF16 };

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__)) || defined(__aarch64__)
constexpr bool kF16InRegisters = true;
#else
constexpr bool kF16InRegisters = false;  // F16 rows go through ConvertRow
#endif

// kLanes values of a row from element c on, as float32.
template <Elem E>
inline Vec LoadAs(const void* row, int64_t c) {
  if constexpr (E == Elem::kF32) {
    return Load(static_cast<const float*>(row) + c);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(row) + c;
#if defined(__AVX512F__)
    return reinterpret_cast<Vec>(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
#elif defined(__AVX2__) && defined(__F16C__)
    return reinterpret_cast<Vec>(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#elif defined(__aarch64__)
    const float32x4_t wide = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(src)));
    Vec v;
    std::memcpy(&v, &wide, sizeof v);
    return v;
#else  // not reached: without vector conversions F16 rows go through ConvertRow
    Vec v;
    for (int i = 0; i < kLanes; ++i) v[i] = HalfToFloat(src[i]);
    return v;
#endif
  }
}

// Everything one call needs; rows of the caches are addressed by their index
// over [num_layers, num_pages, page_size, num_kv_heads] (times head_dim).
struct Problem {
  const float* q;               // [num_rows, num_heads, head_dim], pre-scaled
  float* out;                   // [num_rows, num_heads, head_dim]
  const uint8_t* k;             // the K cache, any supported dtype
  const uint8_t* v;             // the V cache
  ffi::DataType dtype;
  int64_t element_bytes;
  bool in_place;                // float32 rows of whole vectors without scales: read as they are
  Elem elem;                    // how items read rows: kF32 unless float16 rows are read in place
  const float* k_scales;        // [num_layers, num_pages, page_size, num_kv_heads] or null
  const float* v_scales;
  const int32_t* positions;     // [num_rows]
  const int32_t* page_indices;  // [num_seqs, pages_per_seq]
  const int32_t* kv_lens;       // [num_seqs]
  int64_t num_seqs, num_rows, num_heads, head_dim, padded_dim;
  int64_t num_layers, num_pages, page_size, num_kv_heads, pages_per_seq;
  int64_t group, query_block, heads_per_item;  // rows and KV heads of one item at most
  int64_t layer, window;              // window <= 0: none
  float soft_cap;                     // <= 0: none
};

// A sequence's query rows [first, last) (padded: s * q_len onwards).
struct Span {
  int64_t first, last;
};

// One work item: rows [row0, row1) of sequence seq, KV heads [h0, h0 + heads).
struct Item {
  int64_t seq, row0, row1, h0, heads;
};

// Per-thread buffers, padded to whole vectors (the pad stays zero). An item's
// query row r is token r / (heads * group) of its block, query head
// r % (heads * group) of its run of KV heads.
struct Scratch {
  std::vector<float> q, acc, m, l, k_rows, v_rows, zeros;
  std::vector<int64_t> lo, hi, key_rows;
  explicit Scratch(const Problem& p) {
    const int64_t num_rows = p.query_block * p.heads_per_item * p.group;
    q.assign(num_rows * p.padded_dim, 0.0f);
    acc.assign(num_rows * p.padded_dim, 0.0f);
    m.assign(num_rows, 0.0f);
    l.assign(num_rows, 0.0f);
    k_rows.assign(kBlock * p.padded_dim, 0.0f);
    v_rows.assign(kBlock * p.padded_dim, 0.0f);
    zeros.assign(p.padded_dim, 0.0f);
    lo.assign(p.query_block, 0);
    hi.assign(p.query_block, 0);
    key_rows.assign(2 * kBlock, 0);
  }
};

// Cache row `row` converted to float32 (times its scale, when the cache has
// scales) into `buffer`, whose pad past head_dim stays zero.
inline const float* ConvertRow(const Problem& p, const uint8_t* cache, const float* scales,
                              int64_t row, float* buffer) {
  const int64_t d = p.head_dim;
  const int64_t first = row * d;
  const float scale = scales ? scales[row] : 1.0f;
  switch (p.dtype) {
    case ffi::DataType::F32: {
      const float* src = reinterpret_cast<const float*>(cache) + first;
      for (int64_t i = 0; i < d; ++i) buffer[i] = src[i] * scale;
      break;
    }
    case ffi::DataType::BF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(cache) + first;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {  // bfloat16 bits are a float32's top half
        typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t))));
        Half h;
        std::memcpy(&h, src + i, sizeof h);
        const IVec bits = __builtin_convertvector(h, IVec) << 16;
        Store(buffer + i, reinterpret_cast<Vec>(bits) * scale);
      }
      for (; i < d; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof value);
        buffer[i] = value * scale;
      }
      break;
    }
    case ffi::DataType::F16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(cache) + first;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + kLanes <= d; i += kLanes)
        Store(buffer + i, reinterpret_cast<Vec>(_mm512_cvtph_ps(
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)))) *
                              scale);
#elif defined(__AVX2__) && defined(__F16C__)
      for (; i + kLanes <= d; i += kLanes)
        Store(buffer + i, reinterpret_cast<Vec>(_mm256_cvtph_ps(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)))) *
                              scale);
#endif
      for (; i < d; ++i) buffer[i] = HalfToFloat(src[i]) * scale;
      break;
    }
    default: {  // F8E4M3FN, checked by the handler
      const uint8_t* src = cache + first;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) Store(buffer + i, Fp8ToFloat(src + i) * scale);
      const float* table = Fp8Table();
      for (; i < d; ++i) buffer[i] = table[src[i]] * scale;
      break;
    }
  }
  return buffer;
}

// Cache row `row` as float32: read in place when Problem::in_place, else converted.
inline const float* RowAsFloat(const Problem& p, const uint8_t* cache, const float* scales,
                              int64_t row, float* buffer) {
  if (p.in_place) return reinterpret_cast<const float*>(cache) + row * p.head_dim;
  return ConvertRow(p, cache, scales, row, buffer);
}

// Lane shuffles of two vectors by index packs fixed at compile time.
template <int... I>
inline Vec Shuffle(Vec a, Vec b, std::integer_sequence<int, I...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, I...);
#else
  return __builtin_shuffle(a, b, IVec{I...});
#endif
}

template <int S, int... I>
inline Vec SwapLanes(Vec v, std::integer_sequence<int, I...>) {  // lane i <- lane i ^ S
  return Shuffle(v, v, std::integer_sequence<int, (I ^ S)...>{});
}

// Lane 0 (and every lane) of the result: op over v's lanes, as a tree.
template <int S = kLanes / 2, typename Op>
inline float Reduce(Vec v, Op op) {
  v = op(v, SwapLanes<S>(v, std::make_integer_sequence<int, kLanes>{}));
  if constexpr (S > 1) {
    return Reduce<S / 2>(v, op);
  } else {
    return v[0];
  }
}

inline float Sum(Vec v) {
  return Reduce(v, [](Vec a, Vec b) { return a + b; });
}

inline float Max(Vec v) {
  return Reduce(v, [](Vec a, Vec b) { return a > b ? a : b; });
}

// a and b each hold kLanes / G keys' sums over G lanes per key; the result
// holds the keys of a then b, each summed to G / 2 lanes (a key's first half
// of lanes plus its second). G = kLanes starts from one key per vector; after
// G = 2 the result holds one total per lane.
template <int G, int... I>
inline Vec FoldImpl(Vec a, Vec b, std::integer_sequence<int, I...>) {
  constexpr int H = G / 2;
  return Shuffle(a, b, std::integer_sequence<int, (I / H * G + I % H)...>{}) +
         Shuffle(a, b, std::integer_sequence<int, (I / H * G + I % H + H)...>{});
}

template <int G>
inline Vec Fold(Vec a, Vec b) {
  return FoldImpl<G>(a, b, std::make_integer_sequence<int, kLanes>{});
}

// Folds n vectors of keys at G lanes each, pairwise, down to one vector of
// kLanes totals (key b in lane b).
template <int G>
inline Vec FoldAll(Vec* v, int n) {
  for (int i = 0; i < n / 2; ++i) v[i] = Fold<G>(v[2 * i], v[2 * i + 1]);
  if constexpr (G > 2) {
    return FoldAll<G / 2>(v, n / 2);
  } else {
    return v[0];
  }
}

// scores[r], lane b: q row r . k_rows[b], for R query rows (padded_dim apart)
// and a block of kBlock keys (DP: padded_dim when fixed at compile time, else
// 0). Each key's products stay a vector until one transpose-and-add tree sums
// all kBlock at once; the rows share every K load.
template <int R, int DP, Elem E>
void BlockScores(const float* q, const void* const* k_rows, int64_t dp_runtime, Vec* scores) {
  static_assert(kBlock == kLanes, "one score per lane");
  const int64_t padded_dim = DP ? DP : dp_runtime;
  Vec halves[R][kBlock / 2];
  for (int i = 0; i < kBlock / 2; ++i) {
    const void* k0 = k_rows[2 * i];
    const void* k1 = k_rows[2 * i + 1];
    Vec a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = b[r] = Vec{};
    for (int64_t c = 0; c < padded_dim; c += kLanes) {
      const Vec k0c = LoadAs<E>(k0, c), k1c = LoadAs<E>(k1, c);
      for (int r = 0; r < R; ++r) {
        const Vec qc = Load(q + r * padded_dim + c);
        a[r] += qc * k0c;
        b[r] += qc * k1c;
      }
    }
    for (int r = 0; r < R; ++r) halves[r][i] = Fold<kLanes>(a[r], b[r]);
  }
  for (int r = 0; r < R; ++r) scores[r] = FoldAll<kLanes / 2>(halves[r], kBlock / 2);
}

// One online-softmax step of R query rows (padded_dim apart in q and acc)
// over keys [b_lo, b_hi) of a block; the rows share every V load.
template <int R, int DP, Elem E>
void AttendRows(const Problem& p, const float* q, const void* const* k_rows,
                const void* const* v_rows, int b_lo, int b_hi, float* m, float* l,
                float* acc) {
  const int64_t dp = DP ? DP : p.padded_dim;
  Vec scores[R];
  BlockScores<R, DP, E>(q, k_rows, dp, scores);
  IVec lane;
  for (int b = 0; b < kLanes; ++b) lane[b] = b;
  const IVec visible = (lane >= b_lo) & (lane < b_hi);
  const Vec neg_inf = Splat(-std::numeric_limits<float>::infinity());
  float weights[R][kLanes];
  float correction[R];
  for (int r = 0; r < R; ++r) {
    Vec s = p.soft_cap > 0 ? SoftCap(scores[r], p.soft_cap) : scores[r];
    s = visible ? s : neg_inf;
    const float m_new = std::max(m[r], Max(s));
    Vec probs = Exp(s - m_new);
    probs = visible ? probs : Splat(0.0f);
    // On a row's first block m is -inf: the correction clamps to ~1e-38 and scales zeros.
    correction[r] = m[r] == m_new ? 1.0f : Exp(Splat(m[r] - m_new))[0];
    l[r] = l[r] * correction[r] + Sum(probs);
    m[r] = m_new;
    Store(weights[r], probs);
  }
  for (int64_t c = 0; c < dp; c += kLanes) {
    Vec a[R];
    for (int r = 0; r < R; ++r) a[r] = Load(acc + r * dp + c) * correction[r];
    for (int b = b_lo; b < b_hi; ++b) {
      const Vec vb = LoadAs<E>(v_rows[b], c);
      for (int r = 0; r < R; ++r) a[r] += weights[r][b] * vb;
    }
    for (int r = 0; r < R; ++r) Store(acc + r * dp + c, a[r]);
  }
}

// AttendRows over `count` adjacent rows (the query heads of one KV head for
// one token), four at a time.
template <int DP, Elem E>
void AttendGroup(const Problem& p, const float* q, const void* const* k_rows,
                 const void* const* v_rows, int b_lo, int b_hi, float* m, float* l, float* acc,
                 int64_t count) {
  const int64_t dp = p.padded_dim;
  for (int64_t r = 0; r < count; r += 4) {
    const float* qr = q + r * dp;
    float* ar = acc + r * dp;
    switch (std::min<int64_t>(4, count - r)) {
      case 4: AttendRows<4, DP, E>(p, qr, k_rows, v_rows, b_lo, b_hi, m + r, l + r, ar); break;
      case 3: AttendRows<3, DP, E>(p, qr, k_rows, v_rows, b_lo, b_hi, m + r, l + r, ar); break;
      case 2: AttendRows<2, DP, E>(p, qr, k_rows, v_rows, b_lo, b_hi, m + r, l + r, ar); break;
      default: AttendRows<1, DP, E>(p, qr, k_rows, v_rows, b_lo, b_hi, m + r, l + r, ar); break;
    }
  }
}

// Cache rows (for KV head 0) of keys [t0, t0 + count) of a sequence whose page
// table is `pages`: one division per call, not one per key.
inline void KeyRows(const Problem& p, const int32_t* pages, int64_t t0, int64_t count,
                    int64_t* rows) {
  int64_t logical = t0 / p.page_size, offset = t0 % p.page_size;
  const int64_t layer_first = p.layer * p.num_pages;
  for (int64_t b = 0; b < count; ++b) {
    const int64_t page = std::clamp<int64_t>(pages[logical], 0, p.num_pages - 1);
    rows[b] = ((layer_first + page) * p.page_size + offset) * p.num_kv_heads;
    if (++offset == p.page_size) {
      offset = 0;
      ++logical;
    }
  }
}

inline void Prefetch(const Problem& p, const uint8_t* cache, int64_t row, int64_t count) {
  const int64_t row_bytes = p.head_dim * p.element_bytes;
  const uint8_t* first = cache + row * row_bytes;
  for (int64_t i = 0; i < count * row_bytes; i += 64) __builtin_prefetch(first + i, 0, 2);
}

// Visible keys [lo[j], hi[j]) of each token of the block; returns their union's bounds.
std::pair<int64_t, int64_t> VisibleKeys(const Problem& p, int64_t j0, int64_t j1, int64_t kv_len,
                                        Scratch& s) {
  int64_t lo = kv_len, hi = 0;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t pos = p.positions[j];
    const int64_t t_hi = std::min<int64_t>(kv_len, pos + 1);
    const int64_t t_lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    s.lo[j - j0] = t_lo;
    s.hi[j - j0] = t_hi;
    if (t_lo < t_hi) {
      lo = std::min(lo, t_lo);
      hi = std::max(hi, t_hi);
    }
  }
  return {lo, hi};
}

template <int DP, Elem E>
void RunItem(const Problem& p, const Item& item, Scratch& s) {
  const int64_t seq = item.seq, j0 = item.row0, j1 = item.row1;
  const int64_t h0 = item.h0, heads = item.heads;
  const int64_t dp = p.padded_dim, d = p.head_dim, g = p.group;
  const int64_t kv_len = std::clamp<int64_t>(p.kv_lens[seq], 0, p.pages_per_seq * p.page_size);
  const auto [lo, hi] = VisibleKeys(p, j0, j1, kv_len, s);

  // Row r's q and out: token j0 + r / (heads * g), query head h0 * g + r % (heads * g).
  const int64_t rows = (j1 - j0) * heads * g;
  auto offset = [&](int64_t r) {
    const int64_t j = j0 + r / (heads * g), h = h0 * g + r % (heads * g);
    return (j * p.num_heads + h) * d;
  };
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(&s.q[r * dp], p.q + offset(r), d * sizeof(float));
    std::fill(&s.acc[r * dp], &s.acc[r * dp] + dp, 0.0f);
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.0f;
  }

  const void* k_rows[kBlock];
  const void* v_rows[kBlock];
  const int32_t* pages = p.page_indices + seq * p.pages_per_seq;
  int64_t* key_rows = s.key_rows.data();  // this block's rows (KV head 0), then the next's
  KeyRows(p, pages, lo, std::min<int64_t>(kBlock, hi - lo), key_rows);
  for (int64_t t0 = lo; t0 < hi; t0 += kBlock) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, hi - t0));
    const int64_t next = std::clamp<int64_t>(hi - t0 - kBlock, 0, kBlock);
    KeyRows(p, pages, t0 + kBlock, next, key_rows + kBlock);
    for (int64_t h = 0; h < heads; ++h) {
      // One KV head's rows of the next block at a time: a whole block's prefetches at once
      // fill the miss queue and stall the work that could overlap them.
      for (int64_t b = 0; b < next; ++b) {
        Prefetch(p, p.k, key_rows[kBlock + b] + h0 + h, 1);
        Prefetch(p, p.v, key_rows[kBlock + b] + h0 + h, 1);
      }
      for (int b = 0; b < nb; ++b) {
        const int64_t row = key_rows[b] + h0 + h;
        if constexpr (E == Elem::kF32) {
          k_rows[b] = RowAsFloat(p, p.k, p.k_scales, row, &s.k_rows[b * dp]);
          v_rows[b] = RowAsFloat(p, p.v, p.v_scales, row, &s.v_rows[b * dp]);
        } else {
          k_rows[b] = p.k + row * d * 2;
          v_rows[b] = p.v + row * d * 2;
        }
      }
      for (int b = nb; b < kBlock; ++b) k_rows[b] = v_rows[b] = s.zeros.data();
      for (int64_t j = j0; j < j1; ++j) {
        const int b_lo = static_cast<int>(std::max<int64_t>(s.lo[j - j0], t0) - t0);
        const int b_hi = static_cast<int>(std::min<int64_t>(s.hi[j - j0], t0 + nb) - t0);
        if (b_lo >= b_hi) continue;
        const int64_t r = ((j - j0) * heads + h) * g;
        AttendGroup<DP, E>(p, &s.q[r * dp], k_rows, v_rows, b_lo, b_hi, &s.m[r], &s.l[r],
                           &s.acc[r * dp], g);
      }
    }
    std::copy(key_rows + kBlock, key_rows + 2 * kBlock, key_rows);
  }

  for (int64_t r = 0; r < rows; ++r) {
    float* dst = p.out + offset(r);
    const float inv = s.l[r] > 0 ? 1.0f / s.l[r] : 0.0f;
    for (int64_t i = 0; i < d; ++i) dst[i] = s.acc[r * dp + i] * inv;
  }
}

void RunItemOf(const Problem& p, const Item& item, Scratch& s) {
  if (p.elem == Elem::kF16) {  // padded_dim 64 or 128 (SetUpCache)
    if (p.padded_dim == 64) {
      RunItem<64, Elem::kF16>(p, item, s);
    } else {
      RunItem<128, Elem::kF16>(p, item, s);
    }
    return;
  }
  switch (p.padded_dim) {  // the common head sizes get unrolled loops
    case 64: RunItem<64, Elem::kF32>(p, item, s); break;
    case 128: RunItem<128, Elem::kF32>(p, item, s); break;
    default: RunItem<0, Elem::kF32>(p, item, s); break;
  }
}

// Items shared by the calling thread and the pool's tasks. Tasks hold it by
// shared_ptr: one that starts after the call returned finds no item left and
// touches nothing else.
struct Work {
  Problem problem;
  std::vector<Item> items;
  int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;

  void Run() {
    int64_t item = next.fetch_add(1);
    if (item >= total) return;
    Scratch scratch(problem);
    for (; item < total; item = next.fetch_add(1)) {
      RunItemOf(problem, items[item], scratch);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

// The float type whose bits a cache buffer holds: the runtime stores a bfloat16
// or float8 cache on CPU as same-width unsigned integers (layout.py explains why).
ffi::DataType ValueType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U16: return ffi::DataType::BF16;
    case ffi::DataType::U8: return ffi::DataType::F8E4M3FN;
    default: return t;
  }
}

int64_t ElementBytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 4;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F8E4M3FN: return 1;
    default: return 0;  // unsupported
  }
}

// The fields of a Problem that the cache operands give, or false when they
// are unsupported (num_heads and head_dim come from q, whose layout differs).
bool SetUpCache(Problem& p, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> kv_lens,
                float soft_cap) {
  const auto cd = k_cache.dimensions();
  const auto vd = v_cache.dimensions();
  const auto pd = page_indices.dimensions();
  const auto scaled = k_scales.element_count() > 0;
  if (cd.size() != 5 || vd.size() != 5 || pd.size() != 2 ||
      !std::equal(cd.begin(), cd.end(), vd.begin()) ||
      k_cache.element_type() != v_cache.element_type() ||
      ElementBytes(ValueType(k_cache.element_type())) == 0 || cd[4] != p.head_dim ||
      cd[3] < 1 || p.num_heads % cd[3] != 0 ||
      static_cast<int64_t>(kv_lens.element_count()) != pd[0] ||
      (scaled && v_scales.element_count() != k_scales.element_count()) ||
      (scaled && k_scales.element_count() * cd[4] != k_cache.element_count())) {
    return false;
  }
  p.k = static_cast<const uint8_t*>(k_cache.untyped_data());
  p.v = static_cast<const uint8_t*>(v_cache.untyped_data());
  p.dtype = ValueType(k_cache.element_type());
  p.element_bytes = ElementBytes(p.dtype);
  p.k_scales = scaled ? k_scales.typed_data() : nullptr;
  p.v_scales = scaled ? v_scales.typed_data() : nullptr;
  p.page_indices = page_indices.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.num_seqs = pd[0];
  p.pages_per_seq = pd[1];
  p.padded_dim = (p.head_dim + kLanes - 1) / kLanes * kLanes;
  const bool whole = !scaled && p.head_dim == p.padded_dim;
  p.in_place = p.dtype == ffi::DataType::F32 && whole;
  const bool unrolled = p.head_dim == 64 || p.head_dim == 128;
  p.elem = whole && unrolled && p.dtype == ffi::DataType::F16 && kF16InRegisters ? Elem::kF16
                                                                                  : Elem::kF32;
  p.num_layers = cd[0];
  p.num_pages = cd[1];
  p.page_size = cd[2];
  p.num_kv_heads = cd[3];
  p.group = p.num_heads / p.num_kv_heads;
  p.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, p.num_layers - 1);
  p.window = window.typed_data()[0];
  p.soft_cap = soft_cap;
  return true;
}

// The work items of the spans in order (sequence, run of KV heads, block of
// rows): a sequence's items read its pages one after another.
std::vector<Item> MakeItems(const Problem& p, const std::vector<Span>& spans) {
  const int64_t heads_per_item = p.heads_per_item;
  std::vector<Item> items;
  for (int64_t s = 0; s < static_cast<int64_t>(spans.size()); ++s) {
    for (int64_t h0 = 0; h0 < p.num_kv_heads; h0 += heads_per_item) {
      const int64_t heads = std::min(heads_per_item, p.num_kv_heads - h0);
      for (int64_t j0 = spans[s].first; j0 < spans[s].last; j0 += p.query_block) {
        items.push_back({s, j0, std::min(spans[s].last, j0 + p.query_block), h0, heads});
      }
    }
  }
  return items;
}

// Runs every sequence's span of query rows (spans[s] for sequence s) on the
// calling thread and, for calls that read enough rows, XLA's thread pool.
void Launch(ffi::ThreadPool pool, const Problem& problem, const std::vector<Span>& spans,
            int64_t query_block) {
  Problem p = problem;
  // A call that reads few rows (a short decoding sequence) runs on the calling
  // thread alone: handing items to the pool would cost more than it saves.
  int64_t rows_read = 0, most_rows = 1, blocks = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t rows = spans[s].last - spans[s].first;
    rows_read += std::clamp<int64_t>(p.kv_lens[s], 0, p.pages_per_seq * p.page_size) * rows;
    most_rows = std::max(most_rows, rows);
  }
  rows_read *= p.num_kv_heads;
  p.query_block = std::min(query_block, most_rows);
  for (const Span& span : spans) {
    blocks += (span.last - span.first + p.query_block - 1) / p.query_block;
  }
  const int64_t threads = rows_read < kInlineRows ? 0 : pool.num_threads();
  // An item reads whole pages (all its KV heads' rows are adjacent) unless that
  // leaves fewer than two items per thread; then the KV heads split into runs
  // (a lone decoding sequence still keeps every thread busy).
  const int64_t min_items = threads > 0 ? 2 * threads : 1;
  const int64_t head_runs = std::clamp<int64_t>(
      (min_items + blocks - 1) / std::max<int64_t>(blocks, 1), 1, p.num_kv_heads);
  p.heads_per_item = (p.num_kv_heads + head_runs - 1) / head_runs;

  auto work = std::make_shared<Work>();
  work->problem = p;
  work->items = MakeItems(p, spans);
  work->total = static_cast<int64_t>(work->items.size());
  if (work->total == 0 || p.head_dim == 0) return;
  // The calling thread works too, so the pool lends one thread fewer than it has: as many
  // workers as threads (the calling thread is not one of the pool's).
  const int64_t helpers = std::min<int64_t>(threads - 1, work->total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->finished.wait(lock, [&] { return work->done.load() == work->total; });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                              ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                              ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::ResultBuffer<ffi::F32> out, int64_t query_block,
                              float soft_cap) {
  const auto qd = q.dimensions();
  Problem p;
  if (qd.size() == 4) {
    p.num_rows = qd[0] * qd[1];
    p.num_heads = qd[2];
    p.head_dim = qd[3];
  }
  if (qd.size() != 4 || query_block < 1 ||
      !SetUpCache(p, k_cache, v_cache, k_scales, v_scales, layer, window, page_indices, kv_lens,
                  soft_cap) ||
      p.num_seqs != qd[0] || static_cast<int64_t>(positions.element_count()) != p.num_rows) {
    return ffi::Error::InvalidArgument("paged_attention: unsupported shapes or dtypes");
  }
  p.q = q.typed_data();
  p.out = out->typed_data();
  p.positions = positions.typed_data();
  std::vector<Span> spans(p.num_seqs);
  for (int64_t s = 0; s < p.num_seqs; ++s) spans[s] = {s * qd[1], (s + 1) * qd[1]};
  Launch(pool, p, spans, query_block);
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
    ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::S32> positions,
    ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> page_indices,
    ffi::Buffer<ffi::S32> kv_lens, ffi::ResultBuffer<ffi::F32> out, int64_t query_block,
    float soft_cap) {
  const auto qd = q.dimensions();
  Problem p;
  if (qd.size() == 3) {
    p.num_rows = qd[0];
    p.num_heads = qd[1];
    p.head_dim = qd[2];
  }
  if (qd.size() != 3 || query_block < 1 ||
      !SetUpCache(p, k_cache, v_cache, k_scales, v_scales, layer, window, page_indices, kv_lens,
                  soft_cap) ||
      static_cast<int64_t>(q_starts.element_count()) != p.num_seqs + 1 ||
      static_cast<int64_t>(positions.element_count()) != p.num_rows) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: unsupported shapes or dtypes");
  }
  p.q = q.typed_data();
  p.out = out->typed_data();
  p.positions = positions.typed_data();
  // Spans from q_starts, kept inside the rows and non-decreasing whatever they hold; rows
  // outside [first, last) belong to no sequence (padding) and return zeros.
  const int32_t* starts = q_starts.typed_data();
  std::vector<Span> spans(p.num_seqs);
  const int64_t first = std::clamp<int64_t>(starts[0], 0, p.num_rows);
  int64_t row = first;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t next = std::clamp<int64_t>(starts[s + 1], row, p.num_rows);
    spans[s] = {row, next};
    row = next;
  }
  const int64_t row_floats = p.num_heads * p.head_dim;
  std::fill(p.out, p.out + first * row_floats, 0.0f);
  std::fill(p.out + row * row_floats, p.out + p.num_rows * row_floats, 0.0f);
  Launch(pool, p, spans, query_block);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales ([0]: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales ([0]: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (<= 0: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("query_block")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [num_tokens, heads, d]
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales ([0]: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales ([0]: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (<= 0: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [num_tokens]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_starts [num_seqs + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("query_block")
                                  .Attr<float>("soft_cap"));
