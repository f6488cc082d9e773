/* Fused CPU kernels for the two hot spots of a narrow expert (see soma_cluster/fused.py).
 *
 * lstm_block: the sequential part of a bias-free LSTM layer. For every copy and batch row, step through
 * a block of time keeping the state in cache; each step is one small mat-vec (h W_hh^T) plus the gates.
 * Called from soma_cluster/fused.py through ctypes. Rows never interact, so the result does not depend
 * on how the tiles are spread over threads.
 *
 * Layouts (float32, contiguous; G = 4d, gate order i, f, g, o, the g rows pre-scaled by 2 so that
 * tanh(z) = 2 sigmoid(2z) - 1):
 *   gates_in (P, T, B, G)   x W_ih^T, hoisted out of the time loop by the caller
 *   w_hh_t   (P, d, G)      W_hh^T
 *   h, c     (P, B, d)      state, read and updated in place
 *   out      (P, T, B, d)   h at every step
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

#define TILE 8    /* rows that share one pass over a weight matrix */
#define LANES 16  /* partial sums of a reduction, one vector of float32 */

/* exp(x) for float32 (Cephes range reduction and polynomial; relative error at most 8.4e-8 on [-87, 88],
 * checked against double exp in steps of 7.3e-4), written so that the compiler vectorises the loops that
 * call it; x is clamped to [-87, 88], where exp stays a normal float32. */
static inline float exp_approx(float x)
{
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick: floorf would stop the loop from vectorising */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const int32_t bits = ((int32_t)n + 127) << 23;              /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return (p * r * r + r + 1.0f) * scale;
}

/* x[j] <- sigmoid(x[j]), j < n */
static void sigmoid_inplace(float *restrict x, int64_t n)
{
    for (int64_t j = 0; j < n; ++j)
        x[j] = 1.0f / (1.0f + exp_approx(-x[j]));
}

/* One tile: rows r0 .. r0+n-1 of copy p through all T steps. */
static void run_tile(const float *restrict gates_in, const float *restrict w, float *restrict hs, float *restrict cs,
                     float *restrict out, int64_t T, int64_t B, int64_t d, int64_t p, int64_t r0, int64_t n)
{
    const int64_t G = 4 * d;
    float acc[TILE * G], tc[d];
    for (int64_t t = 0; t < T; ++t) {
        memcpy(acc, gates_in + ((p * T + t) * B + r0) * G, (size_t)(n * G) * sizeof(float));
        for (int64_t k = 0; k < d; ++k) {                      /* acc += h W_hh^T, a row of W at a time */
            const float *restrict wk = w + k * G;
            for (int64_t r = 0; r < n; ++r) {
                const float hk = hs[r * d + k];
                float *restrict a = acc + r * G;
                for (int64_t j = 0; j < G; ++j)
                    a[j] += hk * wk[j];
            }
        }
        float *restrict o_t = out + ((p * T + t) * B + r0) * d;
        for (int64_t r = 0; r < n; ++r) {
            float *restrict a = acc + r * G, *restrict hr = hs + r * d, *restrict cr = cs + r * d;
            sigmoid_inplace(a, G);                               /* i, f, (g + 1) / 2, o */
            for (int64_t j = 0; j < d; ++j) {
                cr[j] = a[d + j] * cr[j] + a[j] * (2.0f * a[2 * d + j] - 1.0f);
                tc[j] = 2.0f * cr[j];
            }
            sigmoid_inplace(tc, d);                              /* tanh(c) = 2 sigmoid(2c) - 1 */
            for (int64_t j = 0; j < d; ++j)
                hr[j] = a[3 * d + j] * (2.0f * tc[j] - 1.0f);
            memcpy(o_t + r * d, hr, (size_t)d * sizeof(float));
        }
    }
}

/* All P copies and B rows, tiles spread over the OpenMP threads. Loaded into a process that runs
 * torch, this shares torch's own OpenMP runtime (libgomp.so.1) and therefore its threads. */
void lstm_block(const float *restrict gates_in, const float *restrict w_hh_t, float *restrict h, float *restrict c,
                float *restrict out, int64_t P, int64_t T, int64_t B, int64_t d)
{
    const int64_t tiles = (B + TILE - 1) / TILE;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < P * tiles; ++task) {
        const int64_t p = task / tiles, r0 = (task % tiles) * TILE;
        const int64_t n = (B - r0) < TILE ? (B - r0) : TILE;
        run_tile(gates_in, w_hh_t + p * d * 4 * d, h + (p * B + r0) * d, c + (p * B + r0) * d, out, T, B, d, p, r0, n);
    }
}

/* log p(y) under the byte decoder for C copies of R rows each: log softmax(h E^T)[y].
 *   h        (C, R, e)     decoder inputs (final hidden states)
 *   heads_t  (H, e, 256)   E^T of each head; copy i uses head (i / P) % H (H = 1: one shared head)
 *   y        (C / P, R)    target bytes; copy i uses row group i / P (P copies share targets)
 *   out      (C, R)
 * The 256 logits of a tile of rows stay in cache: no (rows, 256) tensor is ever written. */
void target_logprobs(const float *restrict h, const float *restrict heads_t, const uint8_t *restrict y,
                     float *restrict out, int64_t C, int64_t R, int64_t e, int64_t P, int64_t H)
{
    const int64_t tiles = (R + TILE - 1) / TILE;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < C * tiles; ++task) {
        const int64_t i = task / tiles, r0 = (task % tiles) * TILE;
        const int64_t n = (R - r0) < TILE ? (R - r0) : TILE;
        const float *restrict et = heads_t + ((i / P) % H) * e * 256;
        const float *restrict hs = h + (i * R + r0) * e;
        const uint8_t *restrict ys = y + (i / P) * R + r0;
        float logits[TILE * 256];
        memset(logits, 0, sizeof logits);
        for (int64_t k = 0; k < e; ++k) {
            const float *restrict ek = et + k * 256;
            for (int64_t r = 0; r < n; ++r) {
                const float hk = hs[r * e + k];
                float *restrict l = logits + r * 256;
                for (int64_t v = 0; v < 256; ++v)
                    l[v] += hk * ek[v];
            }
        }
        for (int64_t r = 0; r < n; ++r) {
            float *restrict l = logits + r * 256;
            float lane[LANES], m = l[0], s = 0.0f;          /* per-lane max and sum: vectorised reductions */
            for (int64_t q = 0; q < LANES; ++q)
                lane[q] = l[q];
            for (int64_t v = LANES; v < 256; v += LANES)
                for (int64_t q = 0; q < LANES; ++q)
                    lane[q] = l[v + q] > lane[q] ? l[v + q] : lane[q];
            for (int64_t q = 0; q < LANES; ++q)
                m = lane[q] > m ? lane[q] : m;
            for (int64_t q = 0; q < LANES; ++q)
                lane[q] = 0.0f;
            for (int64_t v = 0; v < 256; v += LANES)
                for (int64_t q = 0; q < LANES; ++q)
                    lane[q] += exp_approx(l[v + q] - m);
            for (int64_t q = 0; q < LANES; ++q)
                s += lane[q];
            out[i * R + r0 + r] = l[ys[r]] - m - logf(s);
        }
    }
}
