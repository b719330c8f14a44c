/* fpemu's compiled quantize loops: float32 in, float32 out, one pass each.
 *
 * fpemu/formats/kernels.py loads this module's shared object with ctypes and calls the fpemu_*
 * functions below; the module itself exports nothing to Python (it is a module only so that
 * setuptools builds it beside fpemu's sources).  Each loop is the numpy arithmetic of a short path
 * (fpemu/formats/_shortcuts.py) or of block quantization (fpemu/blocks/quantize.py) for one element
 * or block, written without branches in its inner loop so the compiler vectorizes it; the numpy paths
 * stay the reference (tests/test_shortcuts.py, tests/test_blocks.py and benchmarks/exhaustive_shortcuts.py
 * compare every path with the numpy one or the bit kernel).
 * Build with IEEE float semantics: no -ffast-math (the rounding is (|x| + t) - t, which must not
 * be reassociated).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* An AVX2 build of each loop beside the baseline one, picked at load time by the CPU (x86-64 with GCC or
 * Clang; elsewhere the baseline only): SSE2, the x86-64 baseline, has no 32-bit integer max or blend.
 * -DFPEMU_BASELINE builds the baseline alone (tests/test_baseline_build.py runs the loops' tests on it). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__) && !defined(FPEMU_BASELINE)
#define FPEMU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FPEMU_CLONES
#endif

static inline float float_of(uint32_t bits) { float f; memcpy(&f, &bits, sizeof f); return f; }
static inline uint32_t bits_of(float f) { uint32_t bits; memcpy(&bits, &f, sizeof bits); return bits; }

/* Nearest even onto a signed format with a zero, subnormals kept: m mantissa bits, min normal
 * 2**emin, greatest binade 2**emax.  |x| + t with t = 2**(e + 23 - m) (e: |x|'s binade, at least
 * emin, at most emax + 1) lands where float32's ulp is the format's quantum at |x|, so the add
 * rounds |x| to it, ties to even, and subtracting t is exact.  A result past max_bits (inf
 * included) becomes past_max_bits (inf, NaN or max finite); NaN stays NaN.  The sign is x's,
 * except for a zero result where the format has no -0 (no_negative_zero). */
FPEMU_CLONES
void fpemu_nearest_even(const uint32_t *restrict in, uint32_t *restrict out, long n, int m, int emin, int emax,
                        uint32_t max_bits, uint32_t past_max_bits, int no_negative_zero) {
    const uint32_t least = (uint32_t)(emin + 127) << 23, greatest = (uint32_t)(emax + 1 + 127) << 23;
    const uint32_t to_magic = (uint32_t)(23 - m) << 23;
    for (long i = 0; i < n; i++) {
        const uint32_t magnitude = in[i] & 0x7FFFFFFFu, sign = in[i] ^ magnitude;
        uint32_t binade = magnitude & 0x7F800000u;
        binade = binade < least ? least : binade;
        binade = binade > greatest ? greatest : binade;
        const float t = float_of(binade + to_magic);
        uint32_t rounded = bits_of((float_of(magnitude) + t) - t);
        rounded = (rounded > max_bits && rounded <= 0x7F800000u) ? past_max_bits : rounded;
        out[i] = rounded | ((no_negative_zero && rounded == 0) ? 0u : sign);
    }
}

/* Nearest even onto float32's leading bits (tf32): the bit pattern rounded at its last kept bit
 * (drop bits below it), the carry crossing binades and reaching inf; NaN inputs are put back (a
 * payload could carry); with saturate_bits (max finite's pattern, else 0) results past it, inf
 * included, become it. */
FPEMU_CLONES
void fpemu_leading_bits(const uint32_t *restrict in, uint32_t *restrict out, long n, int drop,
                        uint32_t saturate_bits) {
    const uint32_t half_less_one = (1u << (drop - 1)) - 1u, keep = 0xFFFFFFFFu << drop;
    for (long i = 0; i < n; i++) {
        const uint32_t bits = in[i], magnitude = bits & 0x7FFFFFFFu, sign = bits ^ magnitude;
        uint32_t rounded = (magnitude + half_less_one + ((magnitude >> drop) & 1u)) & keep;
        rounded = (saturate_bits && rounded > saturate_bits) ? saturate_bits : rounded;
        out[i] = magnitude > 0x7F800000u ? 0x7FC00000u : (rounded | sign);
    }
}

/* float32 onto e8m0 (unsigned powers of two 2**-127 .. 2**127, no zero), nearest with ties up, as
 * _shortcuts._e8m0_nearest: a positive normal x plus 2**22 carries into the exponent exactly when
 * its significand is at least 1.5, and clearing the mantissa leaves the power of two; below
 * 1.5 * 2**-127 gives 2**-127, float32's other subnormals 2**-126, past 1.5 * 2**127 (inf included)
 * 2**127 when saturating and NaN otherwise; +0 and NaN give NaN 0x7FC00000, negative inputs all ones. */
FPEMU_CLONES
void fpemu_e8m0(const uint32_t *restrict in, uint32_t *restrict out, long n, int saturate) {
    const uint32_t past_greatest = saturate ? 0x7F000000u : 0x7FC00000u;
    for (long i = 0; i < n; i++) {
        const uint32_t x = in[i];
        uint32_t r = (x + 0x00400000u) & 0xFF800000u;
        r = x < 0x00600000u ? 0x00400000u : r;
        r = (x >= 0x00600000u && x < 0x00800000u) ? 0x00800000u : r;
        r = (x >= 0x7F400000u && x <= 0x7F800000u) ? past_greatest : r;
        r = (x == 0 || (x > 0x7F800000u && x < 0x80000000u)) ? 0x7FC00000u : r;
        out[i] = x >= 0x80000000u ? 0xFFFFFFFFu : r;
    }
}

/* The element pass of block quantization (fpemu/blocks/quantize.py _fast_elements) for one block of
 * `width` float32 values with a power-of-two scale 2**X (X in [bias - 127, 126]): Veltkamp's split
 * rounds x to m + 1 significant bits (c = x * split, hi = c - (c - x): the dequantized value), and the
 * element code is hi's bits shifted down to exponent and m mantissa bits less the block's offset, with
 * x's sign as the code's top bit.  Elements rounded past max saturate (max_code, +-fl32(max_finite *
 * 2**X), as _saturate does).  Those below min normal (their code wraps above past_max_code) are rounded
 * onto elem's subnormals: y = |x| * 2**-X (exact, or a float32 subnormal far below elem's least value,
 * which rounds to 0 either way) plus t = 2**(emin - m + 23), whose float32 ulp is elem's least value,
 * rounds to it, ties to even; the bits of y + t less t's are the code's magnitude, ((y + t) - t) * 2**X
 * the value (exact).  Needs -ffp-contract=off: a fused multiply-add in the split would round once where
 * numpy rounds twice. */
typedef struct {
    int m, bits, emin;
    uint16_t span, past_max_code;  /* the normal codes' magnitudes less min normal's; rounded past max's */
    uint8_t max_code;
    float max_finite;
} element_format;

static inline void element_block(const float *restrict xb, long width, uint32_t offset, float scale,
                                 const element_format *e, float *restrict vb, uint8_t *restrict cb) {
    const float split = (float)((1u << (23 - e->m)) + 1u);
    const int shift = 23 - e->m, sign_shift = 32 - e->bits;
    const uint32_t magnitude_mask = (1u << (8 + e->m)) - 1u, lowest = 1u << e->m;
    const int32_t span = e->span, past_max_code = e->past_max_code, max_code = e->max_code;
    const uint32_t peak = bits_of(e->max_finite * scale);
    int32_t wrapped = 0;
    for (long j = 0; j < width; j++) {  /* (32-bit lanes: 16-bit ones cost a pack and unpack per vector) */
        const uint32_t sign = bits_of(xb[j]) & 0x80000000u;
        const float c = xb[j] * split;
        const float hi = c - (c - xb[j]);
        /* (int32 compares: AVX2 has no unsigned one; the magnitudes are below 2**16) */
        const int32_t magnitude = (int32_t)(((bits_of(hi) >> shift) - offset) & magnitude_mask);
        const int32_t saturates = (magnitude > span) & (magnitude <= past_max_code);
        wrapped |= magnitude > past_max_code;
        vb[j] = saturates ? float_of(peak | sign) : hi;
        cb[j] = (uint8_t)((uint32_t)(saturates ? max_code : magnitude + (int32_t)lowest) | (sign >> sign_shift));
    }
    if (wrapped) {  /* (zeros, tiny values: a second pass, in the blocks that have them, keeps the first short) */
        const float inverse = float_of((uint32_t)(254 - (bits_of(scale) >> 23)) << 23);  /* 2**-X */
        const float t = float_of((uint32_t)(e->emin - e->m + 23 + 127) << 23);
        for (long j = 0; j < width; j++) {
            const uint32_t x = bits_of(xb[j]), sign = x & 0x80000000u;
            const uint32_t below_min = 0u - (uint32_t)((int32_t)(((bits_of(vb[j]) >> shift) - offset) & magnitude_mask)
                                                       > past_max_code);
            const float y = float_of(x ^ sign) * inverse + t;
            vb[j] = float_of((bits_of(vb[j]) & ~below_min) | ((bits_of((y - t) * scale) | sign) & below_min));
            cb[j] = (uint8_t)((cb[j] & ~below_min) | (((bits_of(y) - bits_of(t)) | (sign >> sign_shift)) & below_min));
        }
    }
}

/* element_block over `blocks` blocks, each with its offset and scale given. */
FPEMU_CLONES
void fpemu_mx_elements(const float *restrict x, const uint16_t *restrict offsets, const float *restrict scales,
                       long blocks, long width, int m, int bits, int emin, uint16_t span, uint16_t past_max_code,
                       uint8_t max_code, float max_finite, float *restrict values, uint8_t *restrict codes) {
    const element_format e = {m, bits, emin, span, past_max_code, max_code, max_finite};
    for (long b = 0; b < blocks; b++) {
        element_block(x + b * width, width, offsets[b], scales[b], &e, values + b * width, codes + b * width);
    }
}

/* The e8m0 scale rules fpemu_mx_blocks computes, as fpemu/blocks/quantize.py's _EXPONENT_RULES do for a
 * positive normal amax below 2**(104 + m) (the blocks it takes): the exact floor, torchao's FLOOR, CEIL and EVEN
 * (on the exponent field), Transformer Engine's float_to_e8m0 of fl32(amax * fl32(1 / max)) (kernel) or
 * of fl32(amax / max) (reference).  Numbered as quantize.py's _COMPILED_EXPONENTS; EXPONENT_GIVEN, after
 * them: the codes are the caller's, in scale_codes (the rules with float32 log2, computed in numpy). */
enum { EXPONENT_FLOOR, EXPONENT_TORCHAO_FLOOR, EXPONENT_TORCHAO_CEIL, EXPONENT_TORCHAO_EVEN, EXPONENT_TE,
       EXPONENT_TE_REFERENCE, EXPONENT_GIVEN };

static inline int32_t te_float_to_e8m0(float value) {
    const uint32_t bits = bits_of(value), exponent = bits >> 23, mantissa = bits & 0x7FFFFFu;
    const int up = mantissa > 0 && exponent != 0xFE && !(exponent == 0 && mantissa <= 0x400000u);
    return value == 0.0f ? 0 : (int32_t)(exponent + up);
}

static inline int32_t e8m0_code(int rule, uint32_t peak, int m, int emax, float max_finite, float max_reciprocal) {
    const int32_t field = (int32_t)(peak >> 23), below_field = (peak & 0x7FFFFFu) != 0;
    int32_t unbiased;
    switch (rule) {
    case EXPONENT_TORCHAO_CEIL: unbiased = field - 127 + below_field - emax; break;
    case EXPONENT_TORCHAO_EVEN:
        unbiased = (int32_t)(((peak + (1u << (23 - m - 1))) & (0x1FFu << 23)) >> 23) - 127 - emax; break;
    case EXPONENT_TE: return te_float_to_e8m0(float_of(peak) * max_reciprocal);
    case EXPONENT_TE_REFERENCE: return te_float_to_e8m0(float_of(peak) / max_finite);
    default: unbiased = field - 127 - emax;  /* FLOOR, torchao FLOOR: the same on normal amaxes */
    }
    return unbiased < -127 ? 0 : unbiased + 127;  /* (no amax near 2**127 comes here: no upper clamp) */
}

/* The integer max of a block's magnitude bits (x's bits with the sign cleared: they order as the
 * magnitudes, NaN above inf). */
static inline uint32_t block_peak(const float *restrict xb, long width) {
    uint32_t peak = 0;
    for (long j = 0; j < width; j++) {
        const uint32_t magnitude = bits_of(xb[j]) & 0x7FFFFFFFu;
        peak = magnitude > peak ? magnitude : peak;
    }
    return peak;
}

/* One MX block (quantize.py _compiled_blocks): its peak (the integer max of the magnitude bits), the rule's
 * scale code, its value 2**(code - 127) and element_block; 0 (nothing written) for a block the element pass
 * does not take: a peak that is not a normal below peak_bound (quantize.py's _peak_bound: NaN, inf, float32
 * subnormals, and zeros unless the block is all zeros), a code outside [bias, 253] or one that leaves the
 * offset no room. */
static inline int mx_block(const float *restrict xb, long width, int rule, const element_format *e, int bias,
                           int emax, uint32_t peak_bound, float max_reciprocal, uint8_t *restrict scale_code,
                           float *restrict scale, float *restrict vb, uint8_t *restrict cb) {
    const uint32_t peak = block_peak(xb, width);
    const int32_t code = !(peak >= 0x00800000u && peak < peak_bound) ? 0
                         : rule == EXPONENT_GIVEN ? *scale_code
                         : e8m0_code(rule, peak, e->m, emax, e->max_finite, max_reciprocal);
    const int32_t offset = ((code - bias) << e->m) + (1 << e->m);
    if (peak == 0 && code == 0) {  /* an all-zero block: every rule's amax-0 code, 2**-127, and x's zeros */
        *scale_code = 0;
        *scale = float_of(0x00400000u);
        for (long j = 0; j < width; j++) {
            vb[j] = xb[j];
            cb[j] = (uint8_t)(bits_of(xb[j]) >> (32 - e->bits));
        }
        return 1;
    }
    if (code < bias || code > 253 || offset + e->past_max_code >= (1 << (8 + e->m))) return 0;
    *scale_code = (uint8_t)code;
    *scale = float_of((uint32_t)code << 23);
    element_block(xb, width, (uint32_t)offset, *scale, e, vb, cb);
    return 1;
}

/* mx_block over `blocks` blocks; the blocks it does not take are listed in slow_blocks (the count of them
 * returned) for quantize.py's numpy arithmetic. */
FPEMU_CLONES
long fpemu_mx_blocks(const float *restrict x, long blocks, long width, int rule, int m, int bits, int bias, int emin,
                     int emax, uint32_t peak_bound, uint16_t span, uint16_t past_max_code, uint8_t max_code,
                     float max_finite, uint8_t *restrict scale_codes, float *restrict scales, float *restrict values,
                     uint8_t *restrict codes, int64_t *restrict slow_blocks) {
    const element_format e = {m, bits, emin, span, past_max_code, max_code, max_finite};
    const float max_reciprocal = 1.0f / max_finite;
    long slow = 0;
    for (long b = 0; b < blocks; b++) {
        /* (MX's 32 as a constant: the compiler unrolls both loops of a block into straight vector code) */
        const int fast = width == 32
            ? mx_block(x + b * 32, 32, rule, &e, bias, emax, peak_bound, max_reciprocal, scale_codes + b, scales + b,
                       values + b * 32, codes + b * 32)
            : mx_block(x + b * width, width, rule, &e, bias, emax, peak_bound, max_reciprocal, scale_codes + b,
                       scales + b, values + b * width, codes + b * width);
        if (!fast) slow_blocks[slow++] = b;
    }
    return slow;
}

/* block_peak of each block of `width` float32 values. */
FPEMU_CLONES
void fpemu_block_peak(const float *restrict x, long blocks, long width, uint32_t *restrict peak) {
    for (long b = 0; b < blocks; b++) peak[b] = block_peak(x + b * width, width);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ckernels",
                                    "fpemu's compiled quantize loops (called through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__ckernels(void) { return PyModule_Create(&module); }
