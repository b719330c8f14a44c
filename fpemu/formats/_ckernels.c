/* fpemu's compiled quantize loops: float32 in, float32 out, one pass each.
 *
 * fpemu/formats/_compiled.py loads this module's shared object with ctypes and calls the two
 * functions below; the module itself exports nothing to Python (it is a module only so that
 * setuptools builds it beside fpemu's sources).  Each loop is the numpy short path's arithmetic
 * (fpemu/formats/_shortcuts.py) for one element, written without branches so the compiler
 * vectorizes it; the numpy paths stay the reference (tests/test_shortcuts.py and
 * benchmarks/exhaustive_shortcuts.py compare every path with the bit kernel).
 * Build with IEEE float semantics: no -ffast-math (the rounding is (|x| + t) - t, which must not
 * be reassociated).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* An AVX2 build of each loop beside the baseline one, picked at load time by the CPU (x86-64 with GCC or
 * Clang; elsewhere the baseline only): SSE2, the x86-64 baseline, has no 32-bit integer max or blend. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__)
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

/* The element pass of block quantization (fpemu/blocks/quantize.py _fast_elements) for blocks of
 * `width` float32 values, each with a power-of-two scale: Veltkamp's split rounds x to m + 1
 * significant bits (c = x * split, hi = c - (c - x): the dequantized value), and the element code
 * is hi's bits shifted down to sign, exponent and m mantissa bits less the block's offset, with the
 * sign moved to the code's top bit.  Elements rounded past max saturate (max_code with x's sign,
 * +-fl32(max_finite * the block's scale), as _saturate does); those below min normal are listed
 * (their flat indices into below_min, *count of them) for the rule's own arithmetic.  Needs
 * -ffp-contract=off: a fused multiply-add in the split would round once where numpy rounds twice. */
FPEMU_CLONES
void fpemu_mx_elements(const float *restrict x, const uint16_t *restrict offsets, const float *restrict scales,
                       long blocks, long width, int m, int bits, uint16_t span, uint16_t past_max_code,
                       uint8_t max_code, float max_finite, float *restrict values, uint8_t *restrict codes,
                       int64_t *restrict below_min, int64_t *restrict count) {
    const float split = (float)((1u << (23 - m)) + 1u);
    const int below = 8 + m;
    const uint16_t magnitude_mask = (uint16_t)((1u << below) - 1u), lowest = (uint16_t)(1u << m);
    const uint16_t sign_bit = (uint16_t)(1u << (bits - 1));
    int64_t under = 0;
    for (long b = 0; b < blocks; b++) {
        const uint16_t offset = offsets[b];
        int outside = 0;
        for (long j = b * width; j < (b + 1) * width; j++) {
            const float c = x[j] * split;
            const float hi = c - (c - x[j]);
            values[j] = hi;
            const uint16_t q = (uint16_t)((uint16_t)(bits_of(hi) >> (23 - m)) - offset);
            const uint16_t magnitude = q & magnitude_mask;
            outside |= magnitude > span;
            codes[j] = (uint8_t)((uint16_t)(magnitude + lowest) | ((uint16_t)(q >> (below - (bits - 1))) & sign_bit));
        }
        if (outside) {  /* (rare: the block's largest elements under a floor scale, zeros, tiny values) */
            for (long j = b * width; j < (b + 1) * width; j++) {
                const uint16_t q = (uint16_t)((uint16_t)(bits_of(values[j]) >> (23 - m)) - offset);
                const uint16_t magnitude = q & magnitude_mask;
                if (magnitude > span && magnitude <= past_max_code) {
                    const float peak = max_finite * scales[b];
                    const int negative = (bits_of(x[j]) >> 31) != 0;
                    values[j] = negative ? -peak : peak;
                    codes[j] = (uint8_t)(max_code | (negative ? sign_bit : 0));
                } else if (magnitude > span) {
                    below_min[under++] = j;
                }
            }
        }
    }
    *count = under;
}

/* The integer max of each block's magnitude bits (x's bits with the sign cleared: they order as the
 * magnitudes, NaN above inf), blocks of `width` float32 values. */
FPEMU_CLONES
void fpemu_block_peak(const uint32_t *restrict x, long blocks, long width, uint32_t *restrict peak) {
    for (long b = 0; b < blocks; b++) {
        uint32_t greatest = 0;
        for (long j = b * width; j < (b + 1) * width; j++) {
            const uint32_t magnitude = x[j] & 0x7FFFFFFFu;
            greatest = magnitude > greatest ? magnitude : greatest;
        }
        peak[b] = greatest;
    }
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ckernels",
                                    "fpemu's compiled quantize loops (called through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__ckernels(void) { return PyModule_Create(&module); }
