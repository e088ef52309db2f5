// Fused single-pass summary statistics of a contiguous CPU tensor, for probes/stats/kernel.py.
//
// stats(x, shift) -> (numel, finite, mean, m2, min, max, nan, inf, neg, pos, zero, shift, deviation):
// the fields of probes.stats.numerics.TensorSummary, then the mean as shift + deviation (`shift`
// given, or the first finite value) so that buckets combine without rounding at the size of the mean.
// row_fields() names them in this order; kernel.py checks the names against its KernelRow on load.
// One pass over memory computes everything:
//  * the data is cut into blocks of kBlock elements; a block keeps (n_b, K_b, S1_b, S2_b) where
//    K_b is the block's first finite value and S1_b = sum(x - K_b), S2_b = sum((x - K_b)^2) in
//    double. Since K_b is one of the values, S2_b <= (n_b + 1) * m2_b, so m2_b = S2_b - S1_b^2/n_b
//    loses at most ~n_b ulps even when the data sits on a huge offset;
//  * after the pass, mean - shift comes from a compensated sum of the block sums, and
//    m2 = sum(m2_b) + sum(n_b * (mean_b - mean)^2) with mean_b - mean formed as
//    ((K_b - shift) + S1_b/n_b) - (mean - shift), so no term carries a rounding error of the size
//    of the offset.
// Blocks of float data are first run through a branch-free vector loop that assumes all values are
// finite; a non-finite S1/S2 proves that assumption wrong (or a float64 overflow) and the block is
// redone by the scalar loop, which handles nan/inf element by element.
//
// Over 400 lines: load_inline builds one source, and the vector loops of every dtype share Totals and Lanes.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// A multiple of 16 (the vector loops' stride); m2 of a block loses at most ~kBlock ulps.
constexpr int64_t kBlock = 1024;

typedef float f8 __attribute__((vector_size(32)));
typedef float f4 __attribute__((vector_size(16)));
typedef double d4 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef int64_t l4 __attribute__((vector_size(32)));

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

struct Totals {
  int64_t nan = 0, inf = 0, neg = 0, pos = 0, zero = 0;
  double fmin = std::numeric_limits<double>::infinity();
  double fmax = -std::numeric_limits<double>::infinity();
  int64_t imin = std::numeric_limits<int64_t>::max();
  int64_t imax = std::numeric_limits<int64_t>::min();
  double m2_within = 0.0;     // sum over blocks of m2_b
  std::vector<double> blocks;  // (n_b, K_b, S1_b) for every block with finite values

  void add_block(int64_t n, double k, double s1, double s2) {
    if (n == 0) return;
    double m2 = s2 - s1 * s1 / static_cast<double>(n);
    m2_within += m2 > 0.0 ? m2 : 0.0;
    blocks.push_back(static_cast<double>(n));
    blocks.push_back(k);
    blocks.push_back(s1);
  }
};

inline double hsum(d4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// Scalar loop for a block of floats or doubles: exact handling of nan/inf, in element order.
template <typename T>
inline void block_scalar(const T* p, int64_t n, Totals& t) {
  int64_t nf = 0;
  double k = 0.0, s1 = 0.0, s2 = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = p[i];
    if (std::isnan(v)) {
      ++t.nan;
      continue;
    }
    if (v < 0.0) ++t.neg;
    else if (v > 0.0) ++t.pos;
    else ++t.zero;
    if (std::isinf(v)) {
      ++t.inf;
      continue;
    }
    if (nf == 0) k = v;
    ++nf;
    const double d = v - k;
    s1 += d;
    s2 += d * d;
    if (v < t.fmin) t.fmin = v;
    if (v > t.fmax) t.fmax = v;
  }
  t.add_block(nf, k, s1, s2);
}

#if defined(__AVX__)
inline d4 widen(const float* p) { return (d4)_mm256_cvtps_pd(_mm_loadu_ps(p)); }
#else
inline d4 widen(const float* p) { return __builtin_convertvector(load<f4>(p), d4); }
#endif

// Per-lane min/max/counts of the blocks that took the vector loop, reduced once at the end.
template <typename E, typename V, typename I>
struct Lanes {
  V lo, hi;
  I neg = {}, zero = {};
  int64_t blocks = 0;

  Lanes() {
    lo = V{} + std::numeric_limits<E>::infinity();
    hi = V{} - std::numeric_limits<E>::infinity();
  }

  void absorb(V block_lo, V block_hi, I block_neg, I block_zero) {
    lo = block_lo < lo ? block_lo : lo;
    hi = block_hi > hi ? block_hi : hi;
    neg += block_neg;
    zero += block_zero;
    ++blocks;
  }

  // Moves the counts into t; with int32 lanes this must happen before a lane can overflow.
  void flush(Totals& t) {
    constexpr int width = sizeof(V) / sizeof(E);
    int64_t nneg = 0, nzero = 0;
    for (int j = 0; j < width; ++j) {
      nneg += neg[j];
      nzero += zero[j];
      if (blocks) {
        t.fmin = lo[j] < t.fmin ? lo[j] : t.fmin;
        t.fmax = hi[j] > t.fmax ? hi[j] : t.fmax;
      }
    }
    t.neg += nneg;
    t.zero += nzero;
    t.pos += blocks * kBlock - nneg - nzero;
    neg = I{};
    zero = I{};
    blocks = 0;
  }
};

using FloatLanes = Lanes<float, f8, i8>;
using DoubleLanes = Lanes<double, d4, l4>;
constexpr int64_t kFlushBlocks = 1 << 16;  // int32 lanes count at most kBlock / 8 per block

// Vector loop for a full block of float32 values; false (and no effect) if a value is not finite.
inline bool block_vector_float(const float* p, FloatLanes& lanes, Totals& t) {
  const double k = p[0];
  // Eight values per iteration and few accumulators: the loop's whole state then fits in the 16
  // vector registers. A spilled accumulator (what a 16-wide unrolled loop gets) costs a third.
  d4 s1 = {}, s2[2] = {};
  f8 lo = load<f8>(p), hi = lo;
  i8 sign = {}, zero = {};
  const i8 izero = {};
  for (int64_t i = 0; i < kBlock; i += 8) {
    const f8 a = load<f8>(p + i);
    lo = a < lo ? a : lo;
    hi = a > hi ? a : hi;
    // Counted on the bits: integer compares leave the float units to min/max, which is ~25%
    // faster on Zen 3. Sign bit set: x < 0 or x == -0.0; bits << 1 == 0: x == +-0.0.
    sign -= ((i8)a < izero);
    zero -= ((u8)a + (u8)a == (u8)izero);
    const d4 d0 = widen(p + i) - k, d1 = widen(p + i + 4) - k;
    s1 += d0 + d1;
    s2[0] += d0 * d0;
    s2[1] += d1 * d1;
  }
  const double sum1 = hsum(s1);
  const double sum2 = hsum(s2[0] + s2[1]);
  if (!std::isfinite(sum1 + sum2)) return false;
  lanes.absorb(lo, hi, sign, zero);
  t.add_block(kBlock, k, sum1, sum2);
  // The lanes count -0.0 as negative and as zero; move those (rare) from negative to positive,
  // which flush() derives as blocks * kBlock - negative - zero.
  int32_t any_sign = 0, any_zero = 0;
  for (int j = 0; j < 8; ++j) {
    any_sign |= sign[j];
    any_zero |= zero[j];
  }
  if (any_sign && any_zero) {
    i8 count = {};
    for (int64_t i = 0; i < kBlock; i += 8) count -= (load<u8>(p + i) == 0x80000000u);
    int64_t negative_zeros = 0;
    for (int j = 0; j < 8; ++j) negative_zeros += count[j];
    t.neg -= negative_zeros;
    t.pos += negative_zeros;
  }
  return true;
}

inline bool block_vector_double(const double* p, DoubleLanes& lanes, Totals& t) {
  const double k = p[0];
  d4 s1 = {}, s2[2] = {};
  d4 lo = load<d4>(p), hi = lo;
  l4 neg = {}, zero = {};
  const d4 dzero = {};
  for (int64_t i = 0; i < kBlock; i += 8) {
    const d4 a = load<d4>(p + i), b = load<d4>(p + i + 4);
    lo = a < lo ? a : lo;
    hi = a > hi ? a : hi;
    lo = b < lo ? b : lo;
    hi = b > hi ? b : hi;
    neg -= (a < dzero);
    zero -= (a == dzero);
    neg -= (b < dzero);
    zero -= (b == dzero);
    const d4 d0 = a - k, d1 = b - k;
    s1 += d0 + d1;
    s2[0] += d0 * d0;
    s2[1] += d1 * d1;
  }
  const double sum1 = hsum(s1);
  const double sum2 = hsum(s2[0] + s2[1]);
  if (!std::isfinite(sum1 + sum2)) return false;
  lanes.absorb(lo, hi, neg, zero);
  t.add_block(kBlock, k, sum1, sum2);
  return true;
}

void run_float(const float* p, int64_t n, Totals& t) {
  FloatLanes lanes;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    if (!block_vector_float(p + i, lanes, t)) block_scalar(p + i, kBlock, t);
    if (lanes.blocks == kFlushBlocks) lanes.flush(t);
  }
  lanes.flush(t);
  if (i < n) block_scalar(p + i, n - i, t);
}

void run_double(const double* p, int64_t n, Totals& t) {
  DoubleLanes lanes;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    if (!block_vector_double(p + i, lanes, t)) block_scalar(p + i, kBlock, t);
  }
  lanes.flush(t);
  if (i < n) block_scalar(p + i, n - i, t);
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal or zero
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

void widen_half(const uint16_t* p, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
  }
#endif
  for (; i < n; ++i) out[i] = half_to_float(p[i]);
}

void widen_bfloat16(const uint16_t* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bits_to_float(static_cast<uint32_t>(p[i]) << 16);
}

// 16-bit floats are widened one block at a time into a buffer that stays in L1.
template <void (*Widen)(const uint16_t*, int64_t, float*)>
void run_16bit(const uint16_t* p, int64_t n, Totals& t) {
  alignas(32) float buffer[kBlock];
  FloatLanes lanes;
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = n - i < kBlock ? n - i : kBlock;
    Widen(p + i, m, buffer);
    if (m < kBlock || !block_vector_float(buffer, lanes, t)) block_scalar(buffer, m, t);
    if (lanes.blocks == kFlushBlocks) lanes.flush(t);
  }
  lanes.flush(t);
}

template <typename T>
void run_int(const T* p, int64_t n, Totals& t) {
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t m = n - start < kBlock ? n - start : kBlock;
    const T* q = p + start;
    T mn = q[0], mx = q[0];
    int64_t neg = 0, zero = 0;
    const double k = static_cast<double>(q[0]);
    double s1[4] = {}, s2[4] = {};
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      for (int j = 0; j < 4; ++j) {
        const T v = q[i + j];
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        neg += v < 0;
        zero += v == 0;
        const double d = static_cast<double>(v) - k;
        s1[j] += d;
        s2[j] += d * d;
      }
    }
    for (; i < m; ++i) {
      const T v = q[i];
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
      neg += v < 0;
      zero += v == 0;
      const double d = static_cast<double>(v) - k;
      s1[0] += d;
      s2[0] += d * d;
    }
    t.neg += neg;
    t.zero += zero;
    t.pos += m - neg - zero;
    if (static_cast<int64_t>(mn) < t.imin) t.imin = static_cast<int64_t>(mn);
    if (static_cast<int64_t>(mx) > t.imax) t.imax = static_cast<int64_t>(mx);
    t.add_block(m, k, (s1[0] + s1[1]) + (s1[2] + s1[3]), (s2[0] + s2[1]) + (s2[2] + s2[3]));
  }
}

struct Moments {
  int64_t finite = 0;
  double shift = 0.0, deviation = 0.0, m2 = 0.0;  // mean = shift + deviation
};

// Combines the block moments; `shift` is the caller's or else the first finite value.
Moments finish(const Totals& t, const double* shift) {
  const std::vector<double>& b = t.blocks;
  Moments out;
  if (shift) out.shift = *shift;
  if (b.empty()) return out;
  if (!shift) out.shift = b[1];
  const double k0 = out.shift;
  double sum = 0.0, compensation = 0.0;  // Neumaier summation of n_b * (K_b - k0) + S1_b
  for (size_t i = 0; i < b.size(); i += 3) {
    out.finite += static_cast<int64_t>(b[i]);
    const double term = b[i] * (b[i + 1] - k0) + b[i + 2];
    const double next = sum + term;
    compensation += std::fabs(sum) >= std::fabs(term) ? (sum - next) + term : (term - next) + sum;
    sum = next;
  }
  out.deviation = (sum + compensation) / static_cast<double>(out.finite);
  double between = 0.0;
  for (size_t i = 0; i < b.size(); i += 3) {
    const double d = ((b[i + 1] - k0) + b[i + 2] / b[i]) - out.deviation;
    between += b[i] * d * d;
  }
  out.m2 = t.m2_within + between;
  return out;
}

// The statistics pass of a contiguous CPU tensor (GIL released by the caller).
struct Pass {
  Totals t;
  Moments moments;
  bool is_float = false;
};

Pass run_pass(const torch::Tensor& x, const double* shift) {
  TORCH_CHECK(x.device().is_cpu(), "probes stats kernel: expected a CPU tensor");
  TORCH_CHECK(x.is_contiguous(), "probes stats kernel: expected a contiguous tensor");
  const int64_t n = x.numel();
  const auto type = x.scalar_type();
  Pass pass;
  pass.is_float = type == torch::kFloat || type == torch::kDouble || type == torch::kHalf ||
                  type == torch::kBFloat16;
  const bool is_int = type == torch::kInt8 || type == torch::kInt16 || type == torch::kInt32 ||
                      type == torch::kInt64 || type == torch::kUInt8 || type == torch::kBool;
  TORCH_CHECK(pass.is_float || is_int, "probes stats kernel: unsupported dtype ", type);
  Totals& t = pass.t;
  t.blocks.reserve(3 * (n / kBlock + 1));
  const void* data = x.data_ptr();
  switch (type) {
    case torch::kFloat: run_float(static_cast<const float*>(data), n, t); break;
    case torch::kDouble: run_double(static_cast<const double*>(data), n, t); break;
    case torch::kHalf: run_16bit<widen_half>(static_cast<const uint16_t*>(data), n, t); break;
    case torch::kBFloat16: run_16bit<widen_bfloat16>(static_cast<const uint16_t*>(data), n, t); break;
    case torch::kInt8: run_int(static_cast<const int8_t*>(data), n, t); break;
    case torch::kInt16: run_int(static_cast<const int16_t*>(data), n, t); break;
    case torch::kInt32: run_int(static_cast<const int32_t*>(data), n, t); break;
    case torch::kInt64: run_int(static_cast<const int64_t*>(data), n, t); break;
    case torch::kUInt8: run_int(static_cast<const uint8_t*>(data), n, t); break;
    case torch::kBool: run_int(static_cast<const uint8_t*>(data), n, t); break;
    default: break;  // rejected above
  }
  pass.moments = finish(t, shift);
  return pass;
}

// A row: see row_fields() below for its names (deviation = mean - shift).
py::tuple stats(const torch::Tensor& x, py::object shift) {
  const bool has_shift = !shift.is_none();
  const double shift_value = has_shift ? shift.cast<double>() : 0.0;
  Pass pass;
  {
    py::gil_scoped_release no_gil;
    pass = run_pass(x, has_shift ? &shift_value : nullptr);
  }
  const Totals& t = pass.t;
  const Moments& moments = pass.moments;
  const int64_t n = x.numel();
  const int64_t finite = moments.finite;
  py::object none = py::none();
  py::object mean = finite ? py::object(py::float_(moments.shift + moments.deviation)) : none;
  py::object lo = none, hi = none;
  if (finite && pass.is_float) {
    lo = py::float_(t.fmin);
    hi = py::float_(t.fmax);
  } else if (finite) {
    lo = py::int_(t.imin);
    hi = py::int_(t.imax);
  }
  return py::make_tuple(n, finite, mean, moments.m2, lo, hi, t.nan, t.inf, t.neg, t.pos, t.zero,
                        moments.shift, moments.deviation);
}

inline double int_bits(int64_t v) {
  double d;
  std::memcpy(&d, &v, sizeof(d));
  return d;
}

template <typename T>
void put_samples(const T* p, const int64_t* at, int64_t k, double* out, bool is_float) {
  for (int64_t i = 0; i < k; ++i) {
    out[i] = is_float ? static_cast<double>(p[at[i]]) : int_bits(static_cast<int64_t>(p[at[i]]));
  }
}

// The device-row form of stats(): the first 11 fields of row_fields() (no shift, deviation) as float64
// into out[row, 0:11], then x's values at the flat `indices` into out[row, 11:]. Integer min/max and
// samples are int64 bit patterns; mean is nan, min +inf and max -inf when no element is finite.
// Below this many elements a row is written holding the GIL: releasing and taking it back costs more than
// the pass, and a thread holding the GIL meanwhile (the dump writer) would make the training thread wait.
constexpr int64_t kReleaseGilAbove = 1 << 15;

// The row of x into o (the 11 accumulated fields, then x's values at the k flat indices `at`).
void write_row(const torch::Tensor& x, double* o, const int64_t* at, int64_t k) {
  const int64_t n = x.numel();
  std::optional<py::gil_scoped_release> no_gil;
  if (n > kReleaseGilAbove) no_gil.emplace();
  const Pass pass = run_pass(x, nullptr);
  const Totals& t = pass.t;
  const int64_t finite = pass.moments.finite;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  o[0] = static_cast<double>(n);
  o[1] = static_cast<double>(finite);
  o[2] = finite ? pass.moments.shift + pass.moments.deviation : nan;
  o[3] = pass.moments.m2;
  if (pass.is_float) {
    o[4] = t.fmin;
    o[5] = t.fmax;
  } else {
    o[4] = int_bits(t.imin);
    o[5] = int_bits(t.imax);
  }
  o[6] = static_cast<double>(t.nan);
  o[7] = static_cast<double>(t.inf);
  o[8] = static_cast<double>(t.neg);
  o[9] = static_cast<double>(t.pos);
  o[10] = static_cast<double>(t.zero);
  const void* data = x.data_ptr();
  double* s = o + 11;
  switch (x.scalar_type()) {
    case torch::kFloat: put_samples(static_cast<const float*>(data), at, k, s, true); break;
    case torch::kDouble: put_samples(static_cast<const double*>(data), at, k, s, true); break;
    case torch::kHalf: {
      const uint16_t* p = static_cast<const uint16_t*>(data);
      for (int64_t i = 0; i < k; ++i) s[i] = half_to_float(p[at[i]]);
      break;
    }
    case torch::kBFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(data);
      for (int64_t i = 0; i < k; ++i) s[i] = bits_to_float(static_cast<uint32_t>(p[at[i]]) << 16);
      break;
    }
    case torch::kInt8: put_samples(static_cast<const int8_t*>(data), at, k, s, false); break;
    case torch::kInt16: put_samples(static_cast<const int16_t*>(data), at, k, s, false); break;
    case torch::kInt32: put_samples(static_cast<const int32_t*>(data), at, k, s, false); break;
    case torch::kInt64: put_samples(static_cast<const int64_t*>(data), at, k, s, false); break;
    case torch::kUInt8: put_samples(static_cast<const uint8_t*>(data), at, k, s, false); break;
    case torch::kBool: put_samples(static_cast<const uint8_t*>(data), at, k, s, false); break;
    default: break;
  }
}

void check_out(const torch::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kDouble && out.dim() == 2 &&
                  out.is_contiguous(), "probes stats kernel: out must be a contiguous 2-d float64 CPU tensor");
}

void row_into(const torch::Tensor& x, torch::Tensor& out, int64_t row, const torch::Tensor& indices) {
  check_out(out);
  TORCH_CHECK(indices.device().is_cpu() && indices.scalar_type() == torch::kLong && indices.is_contiguous(),
              "probes stats kernel: indices must be a contiguous int64 CPU tensor");
  const int64_t k = indices.numel();
  TORCH_CHECK(row >= 0 && row < out.size(0) && 11 + k <= out.size(1), "probes stats kernel: row out of range");
  const int64_t n = x.numel();
  const int64_t* at = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) TORCH_CHECK(at[i] >= 0 && at[i] < n, "probes stats kernel: sample index out of range");
  write_row(x, out.data_ptr<double>() + row * out.size(1), at, k);
}

bool kernel_dtype(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat: case torch::kDouble: case torch::kHalf: case torch::kBFloat16: case torch::kInt8:
    case torch::kInt16: case torch::kInt32: case torch::kInt64: case torch::kUInt8: case torch::kBool:
      return true;
    default:
      return false;
  }
}

// row_into for the common tensor, checks included, in one call: a plain (strided, not nested, not lazily
// negated) contiguous CPU tensor of a kernel dtype with 0 < numel <= limit. The samples are taken at
// probes.stats.numerics.sample_indices(numel, count), computed here by the same integer formula. False,
// with nothing written, for any other tensor (the caller takes the general path).
bool fast_row(const torch::Tensor& x, torch::Tensor& out, int64_t row, int64_t count, int64_t limit) {
  if (!x.defined() || !x.device().is_cpu() || x.layout() != torch::kStrided || x.is_nested() ||
      !kernel_dtype(x.scalar_type()) || !x.is_contiguous() || x.is_neg()) {
    return false;
  }
  const int64_t n = x.numel();
  if (n <= 0 || n > limit) return false;
  check_out(out);
  const int64_t k = count <= 0 ? 0 : std::min(count, n);
  TORCH_CHECK(row >= 0 && row < out.size(0) && 11 + k <= out.size(1), "probes stats kernel: row out of range");
  std::vector<int64_t> at(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    at[i] = count >= n ? i : (count == 1 ? 0 : i * (n - 1) / (count - 1));
  }
  write_row(x, out.data_ptr<double>() + row * out.size(1), at.data(), k);
  return true;
}

// fast_row as a plain CPython function (METH_FASTCALL): pybind11's argument conversion costs about 1 us a call,
// more than the row of a small tensor; this is called once per record.
PyObject* fast_row_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !THPVariable_Check(args[0]) || !THPVariable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "fast_row(x: Tensor, out: Tensor, row: int, count: int, limit: int)");
    return nullptr;
  }
  const int64_t row = PyLong_AsLongLong(args[2]);
  const int64_t count = PyLong_AsLongLong(args[3]);
  const int64_t limit = PyLong_AsLongLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  try {
    torch::Tensor out = THPVariable_Unpack(args[1]);
    if (fast_row(THPVariable_Unpack(args[0]), out, row, count, limit)) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}

PyMethodDef fast_methods[] = {
    {"fast_row", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fast_row_py)), METH_FASTCALL,
     "fast_row(x, out, row, count, limit): row_into of a plain contiguous CPU tensor of a kernel dtype and "
     "0 < numel <= limit, its samples at sample_indices(numel, count); False (nothing written) for any other "
     "tensor"},
    {nullptr, nullptr, 0, nullptr}};

// probes/stats/hashing.py's hash of a contiguous CPU tensor's bytes (the definition and its reasons are
// there): S = sum of mix(w_i + (i + 1) * G) over the 64-bit little-endian words, the last padded with
// zero bytes; hash = mix(S + (n + 1) * G), n the byte count; all modulo 2^64. Written as int64 bits into
// out[row, col].
inline uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

void hash_into(const torch::Tensor& x, torch::Tensor& out, int64_t row, int64_t col) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kDouble && out.dim() == 2 &&
                  out.is_contiguous(), "probes stats kernel: out must be a contiguous 2-d float64 CPU tensor");
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && !x.is_neg() && !x.is_conj(),
              "probes stats kernel: hash_into needs a contiguous CPU tensor");
  TORCH_CHECK(row >= 0 && row < out.size(0) && col >= 0 && col < out.size(1), "probes stats kernel: row out of range");
  const uint64_t G = 0x9E3779B97F4A7C15ULL;
  const uint64_t n = static_cast<uint64_t>(x.numel()) * x.element_size();
  const unsigned char* p = n ? static_cast<const unsigned char*>(x.data_ptr()) : nullptr;
  double* o = out.data_ptr<double>() + row * out.size(1) + col;
  std::optional<py::gil_scoped_release> no_gil;
  if (n > 8 * kReleaseGilAbove) no_gil.emplace();  // n counts bytes
  const uint64_t whole = n / 8;
  uint64_t s = 0;
  for (uint64_t i = 0; i < whole; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);  // unaligned-safe; little-endian hosts only (x86, arm)
    s += mix64(w + (i + 1) * G);
  }
  if (n % 8) {
    uint64_t w = 0;
    std::memcpy(&w, p + 8 * whole, n % 8);
    s += mix64(w + (whole + 1) * G);
  }
  const uint64_t h = mix64(s + (n + 1) * G);
  std::memcpy(o, &h, 8);
}

// The names of stats()'s fields, in its order: change both together.
py::tuple row_fields() {
  return py::make_tuple("numel", "finite", "mean", "m2", "min", "max", "nan", "inf", "neg", "pos", "zero",
                        "shift", "deviation");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stats", &stats, py::arg("x"), py::arg("shift") = py::none(),
        "(numel, finite, mean, m2, min, max, nan, inf, neg, pos, zero, shift, deviation) of a "
        "contiguous CPU tensor; pass the shift of a previous bucket to combine buckets exactly");
  m.def("row_fields", &row_fields, "the names of stats()'s fields, in its order");
  m.def("row_into", &row_into, py::arg("x"), py::arg("out"), py::arg("row"), py::arg("indices"),
        "stats() of x without shift/deviation, then x's values at indices, into the float64 row out[row]");
  if (PyModule_AddFunctions(m.ptr(), fast_methods) != 0) throw py::error_already_set();
  m.def("hash_into", &hash_into, py::arg("x"), py::arg("out"), py::arg("row"), py::arg("col"),
        "the 64-bit hash of x's bytes (probes/stats/hashing.py) as int64 bits into out[row, col]");
}
