/* Small math shared by pdserve's native kernels (included, not compiled on its own). */
#ifndef PDSERVE_FASTMATH_H
#define PDSERVE_FASTMATH_H

#include <stdint.h>
#include <string.h>

/* e^x, vectorizable inline: 2^(x log2 e) split into an integer power, put straight into
 * the exponent bits, and a degree-6 polynomial for the fraction; relative error below
 * 2e-7 over [-87, 88], inputs clamped to that range. libm's vector expf is a call per
 * vector, and it falls back to scalar code, lane by lane, for inputs far below zero:
 * the masked scores of a softmax, so a causal kernel spent a third of its time there. */
static inline float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_floorf(t);
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

#endif
