/* Fused CPU kernels for narrow experts (see soma_cluster/fused.py). Called through ctypes.
 *
 * expert_forward: the whole expert, embedding to log p(target), for a tile of batch rows of one copy at
 *   a time, step by step. Every activation of the tile stays in L1/L2; the copy's weights (160 KiB at
 *   d = 32) stay in L2. Nothing of size (copies, T, B, 4d) is ever written.
 * lstm_block: the sequential part of one LSTM layer (h W_hh^T + the cell), for the torch-composed path.
 * target_logprobs: log p(target) under the byte decoder, for the torch-composed path.
 *
 * All three are built from one register-blocked matmul: a block of rb rows x nv vectors of output columns
 * is accumulated in registers over the whole reduction (one weight vector load feeds rb FMAs, one
 * broadcast feeds nv), and a fused epilogue (store, add, exact GELU, or the LSTM cell) runs on the
 * registers before anything is written. The vector width is the machine's, chosen at build time:
 * AVX-512 (16 lanes), AVX2+FMA (8), else GCC's generic vectors (4 lanes: SSE2, NEON, or scalar code).
 * Rows never interact and every reduction has a fixed order, so results do not depend on the number of
 * threads or on how the tiles are spread over them.
 *
 * The whole-expert kernel reads each copy's flat body (model.Layout's order, located by the caller's offsets)
 * and packs it once per thread into the layout below (D, E, H are d, e, 4d rounded up to the vector width,
 * padding is zero):
 *   proj_in^T (E, D)                                      wide experts only (d != e)
 *   per block: ln1 (D), Wx (2D, 4D), ln2 (D), W1^T (D, H), W2^T (H, D)
 *   lnf (D)
 *   proj_out^T (D, E)                                     wide experts only
 * Wx is [W_ih^T; W_hh^T] with the columns of each VL hidden units' four gates side by side
 * (unit chunk j: i, f, g, o, VL columns each) and the g columns pre-scaled by 2, so one sigmoid serves
 * all four gates: tanh(z) = 2 sigmoid(2z) - 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define ACC_REGS 24     /* accumulators of a register block: 32 zmm, minus weights and broadcasts */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define ACC_REGS 12     /* 16 ymm */
#else
#define VL 4
#define ACC_REGS 8
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));    /* unaligned loads and stores */
typedef int32_t vi __attribute__((vector_size(4 * VL)));
#define INLINE static inline __attribute__((always_inline))
#define LN_EPS 1e-5f
#define VOCAB 256

INLINE vf vload(const float *p) { return *(const vfu *)p; }
INLINE void vstore(float *p, vf v) { *(vfu *)p = v; }

/* A weight vector of a register block of rb rows, which feeds rb FMAs. For rb > 1 the load is kept in a register:
 * left to itself GCC folds it into each FMA when rb is small (4 rows: 16 vector loads per 16 FMAs instead of 4),
 * which made the block load-bound on this host (AMD EPYC, AVX-512): blocks of 2 to 4 rows per copy ran 10-16%
 * slower (benchmarks/bench_kernels.py, rows table). With one row each load feeds one FMA either way, so it is left
 * to the compiler there. */
INLINE vf vload_weight(const float *p, const int rb)
{
    vf v = vload(p);
#if defined(__GNUC__) && (VL == 16 || VL == 8)
    if (rb > 1)
        __asm__("" : "+v"(v));
#else
    (void)rb;
#endif
    return v;
}

#if VL == 16
INLINE vf vset(float s) { return (vf)_mm512_set1_ps(s); }
INLINE vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
INLINE vf vmin(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
INLINE float vsum(vf a) { return _mm512_reduce_add_ps((__m512)a); }
INLINE float vhmax(vf a) { return _mm512_reduce_max_ps((__m512)a); }
#elif VL == 8
INLINE vf vset(float s) { return (vf)_mm256_set1_ps(s); }
INLINE vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
INLINE vf vmin(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
INLINE float vsum(vf a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
INLINE float vhmax(vf a)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#else
INLINE vf vset(float s) { return (vf){s, s, s, s}; }
INLINE vf vmax(vf a, vf b) { vf r; for (int i = 0; i < VL; ++i) r[i] = a[i] > b[i] ? a[i] : b[i]; return r; }
INLINE vf vmin(vf a, vf b) { vf r; for (int i = 0; i < VL; ++i) r[i] = a[i] < b[i] ? a[i] : b[i]; return r; }
INLINE float vsum(vf a) { return (a[0] + a[2]) + (a[1] + a[3]); }
INLINE float vhmax(vf a) { float m = a[0]; for (int i = 1; i < VL; ++i) m = a[i] > m ? a[i] : m; return m; }
#endif

/* 1 / x for x >= 0.01 (never near a denormal or an infinity): the hardware's reciprocal estimate and one
 * Newton step, within 1 ulp of the quotient and several times the throughput of a division */
#if VL == 16
INLINE vf vrecip(vf x)
{
    const vf r = (vf)_mm512_rcp14_ps((__m512)x);                 /* relative error < 2^-14 */
    return r + r * (1.0f - x * r);
}
#elif VL == 8
INLINE vf vrecip(vf x)
{
    vf r = (vf)_mm256_rcp_ps((__m256)x);                         /* relative error < 1.5 * 2^-12 */
    r = r + r * (1.0f - x * r);
    return r + r * (1.0f - x * r);
}
#else
INLINE vf vrecip(vf x) { return 1.0f / x; }
#endif

/* the first n lanes of p, zeros after (never reads past p + n) */
INLINE vf vload_part(const float *p, int64_t n)
{
    vf r = vset(0.0f);
    for (int64_t i = 0; i < n; ++i)
        r[i] = p[i];
    return r;
}

INLINE void vstore_part(float *p, vf v, int64_t n)
{
    for (int64_t i = 0; i < n; ++i)
        p[i] = v[i];
}

/* exp(x) for float32 (Cephes range reduction and polynomial; relative error at most 8.4e-8 on [-87, 88],
 * checked against double exp in steps of 7.3e-4); x is clamped to [-87, 88], where exp stays normal. */
INLINE vf vexp(vf x)
{
    x = vmin(vmax(x, vset(-87.0f)), vset(88.0f));
#if VL == 16
    const vf n = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round(x / ln 2) */
#endif
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
#if VL == 16
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);                     /* p 2^n */
#else
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;        /* 2^n */
    return p * (vf)scale;
#endif
}

INLINE vf vsigmoid(vf x) { return vrecip(1.0f + vexp(-x)); }

/* Exact GELU, x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, not the tanh approximation. erf(z) by the odd/even
 * rational minimax form of Eigen and XLA (z clamped to [-4, 4], where erf rounds to +-1 in float32): absolute
 * error at most 4.5e-7 and relative at most 4.5e-7 against float64, with no exp. Against float64 on [-30, 30]
 * GELU's error is at most 2.0e-7 |x| here and 3.6e-7 |x| for torch's own F.gelu (Abramowitz-Stegun erf). */
INLINE vf verf(vf z)
{
    z = vmin(vmax(z, vset(-4.0f)), vset(4.0f));
    const vf z2 = z * z;
    vf p = z2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
    p = p * z2 - 2.10102402082508e-06f;
    p = p * z2 - 5.69250639462346e-05f;
    p = p * z2 - 7.34990630326855e-04f;
    p = p * z2 - 2.95459980854025e-03f;
    p = p * z2 - 1.60960333262415e-02f;
    vf q = z2 * -1.45660718464996e-05f - 2.13374055278905e-04f;
    q = q * z2 - 1.68282697438203e-03f;
    q = q * z2 - 7.37332916720468e-03f;
    q = q * z2 - 1.42647390514189e-02f;                           /* q <= -0.0142: never near zero */
    return z * p * vrecip(-q) * -1.0f;
}

INLINE vf vgelu(vf x) { return x * 0.5f * (1.0f + verf(x * 0.70710678118654752f)); }

/* ---------------------------------------------------------------------------------------------------
 * The register-blocked matmul: out[r][cols] (op)= sum_k a[r][k] w[k][cols], for rb rows of a (stride lda)
 * and nv vectors of columns of w (stride ldw). a is read by scalar broadcasts, so its rows need no padding.
 */
enum { EPI_STORE, EPI_ADD, EPI_GELU };

/* Epilogues that need many constants live in functions of their own, applied to the block once it is
 * stored (in L1): inlined, the compiler would keep their constants in registers across the reduction loop
 * and spill accumulators to make room. */
static __attribute__((noinline)) void gelu_rows(int rb, int nv, float *out, int64_t ldo)
{
    for (int r = 0; r < rb; ++r)
        for (int v = 0; v < nv; ++v)
            vstore(out + r * ldo + v * VL, vgelu(vload(out + r * ldo + v * VL)));
}

INLINE void mm_block(const int rb, const int nv, const int epi, const float *restrict a, int64_t lda,
                     const float *restrict w, int64_t ldw, int64_t K, float *restrict out, int64_t ldo)
{
    vf acc[8][4];
#pragma GCC unroll 8
    for (int r = 0; r < rb; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v)
            acc[r][v] = vset(0.0f);
    for (int64_t k = 0; k < K; ++k) {
        vf wv[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v)
            wv[v] = vload_weight(w + k * ldw + v * VL, rb);
#pragma GCC unroll 8
        for (int r = 0; r < rb; ++r) {
            const vf av = vset(a[r * lda + k]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; ++v)
                acc[r][v] += av * wv[v];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rb; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v) {
            float *o = out + r * ldo + v * VL;
            if (epi == EPI_ADD)
                vstore(o, vload(o) + acc[r][v]);
            else
                vstore(o, acc[r][v]);
        }
    if (epi == EPI_GELU)
        gelu_rows(rb, nv, out, ldo);
}

/* rows per block when n rows go in blocks of at most `most`: as even as the count allows (8 rows as 4 + 4, not
 * 6 + 2), so no block is left with too few rows to keep the FMA units busy */
static int64_t balanced(int64_t n, int64_t most)
{
    const int64_t blocks = (n + most - 1) / most;
    return (n + blocks - 1) / blocks;
}

#define RB_MAX(nv) ((ACC_REGS) / (nv) < 8 ? (ACC_REGS) / (nv) : 8)
#define MM_ROWS(EPI, NV)                                                                                    \
    switch (rb) {                                                                                           \
    case 1: mm_block(1, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                      \
    case 2: mm_block(2, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                      \
    case 3: mm_block(3, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                      \
    case 4: mm_block(4, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                      \
    case 5: mm_block(5, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                      \
    case 6: mm_block(6, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                      \
    case 7: mm_block(7, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                      \
    default: mm_block(8, NV, EPI, a_, lda, w_, ldw, K, o_, ldo); break;                                     \
    }
#define MM_COLS(EPI)                                                                                        \
    switch (nv) {                                                                                           \
    case 1: MM_ROWS(EPI, 1) break;                                                                          \
    case 2: MM_ROWS(EPI, 2) break;                                                                          \
    case 3: MM_ROWS(EPI, 3) break;                                                                          \
    default: MM_ROWS(EPI, 4) break;                                                                         \
    }

/* out (n, N) (op)= a (n, K) w (K, N), N a multiple of VL: column groups of up to 4 vectors (the group's
 * slice of w stays in L1 across all row blocks), row blocks as many as the registers hold. */
static void mm(int epi, const float *a, int64_t lda, const float *w, int64_t ldw, int64_t K, int64_t N,
               int64_t n, float *out, int64_t ldo)
{
    for (int64_t c0 = 0; c0 < N / VL; c0 += 4) {
        const int nv = (int)(N / VL - c0 < 4 ? N / VL - c0 : 4);
        const int64_t step = balanced(n, RB_MAX(nv));
        for (int64_t r0 = 0; r0 < n; r0 += step) {
            const int rb = (int)(n - r0 < step ? n - r0 : step);
            const float *a_ = a + r0 * lda, *w_ = w + c0 * VL;
            float *o_ = out + r0 * ldo + c0 * VL;
            if (epi == EPI_STORE) {
                MM_COLS(EPI_STORE)
            } else if (epi == EPI_ADD) {
                MM_COLS(EPI_ADD)
            } else {
                MM_COLS(EPI_GELU)
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------
 * The LSTM cell fused into its matmul. For rb rows and one chunk of VL hidden units, the four gate
 * vectors are accumulated in registers over K = rows of w, starting from gin (x W_ih^T given by the caller,
 * gate q of the chunk at gin[r * ldg + q * gstride], `lanes` valid) or from zero; then
 *   i, f, g', o = sigmoid(acc)    (g' = (tanh(g) + 1) / 2, as its columns are pre-scaled by 2)
 *   c = f c + i (2 g' - 1),   h = o tanh(c) = o (2 sigmoid(2c) - 1)
 * c is updated in place, h written to hout, and added to res when given (the residual stream).
 */
static __attribute__((noinline)) void lstm_cell(int rb, float gates[][4][VL], float *restrict c, int64_t ldc,
                                                 float *restrict hout, int64_t ldh, float *restrict res, int64_t ldr)
{
    for (int r = 0; r < rb; ++r) {
        const vf i = vsigmoid(vload(gates[r][0])), f = vsigmoid(vload(gates[r][1]));
        const vf g = vsigmoid(vload(gates[r][2])), o = vsigmoid(vload(gates[r][3]));
        const vf cn = f * vload(c + r * ldc) + i * (2.0f * g - 1.0f);
        const vf h = o * (2.0f * vsigmoid(2.0f * cn) - 1.0f);
        vstore(c + r * ldc, cn);
        vstore(hout + r * ldh, h);
        if (res)
            vstore(res + r * ldr, vload(res + r * ldr) + h);
    }
}

INLINE void lstm_block_rows(const int rb, const float *restrict a, int64_t lda, const float *restrict w, int64_t ldw,
                            int64_t K, const float *restrict gin, int64_t ldg, int64_t gstride, int64_t lanes,
                            float *restrict c, int64_t ldc, float *restrict hout, int64_t ldh, float *restrict res,
                            int64_t ldr)
{
    vf acc[6][4];
#pragma GCC unroll 8
    for (int r = 0; r < rb; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
            acc[r][q] = gin == 0 ? vset(0.0f)
                        : lanes == VL ? vload(gin + r * ldg + q * gstride) : vload_part(gin + r * ldg + q * gstride, lanes);
    for (int64_t k = 0; k < K; ++k) {
        vf wv[4];
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
            wv[q] = vload_weight(w + k * ldw + q * VL, rb);
#pragma GCC unroll 8
        for (int r = 0; r < rb; ++r) {
            const vf av = vset(a[r * lda + k]);
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q)
                acc[r][q] += av * wv[q];
        }
    }
    float gates[6][4][VL] __attribute__((aligned(64)));
#pragma GCC unroll 8
    for (int r = 0; r < rb; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
            vstore(gates[r][q], acc[r][q]);
    lstm_cell(rb, gates, c, ldc, hout, ldh, res, ldr);
}

#define LSTM_RB (ACC_REGS / 4 > 6 ? 6 : ACC_REGS / 4)     /* rows of a block: 4 gate vectors each */

/* One step of an LSTM layer for n rows: every chunk of VL hidden units of D (see lstm_block_rows). gin,
 * when given, is the standard (i, f, g, o) layout of d columns per gate. */
static void lstm_rows(const float *a, int64_t lda, const float *w, int64_t K, int64_t D, const float *gin, int64_t ldg,
                      int64_t d, float *c, int64_t ldc, float *hout, int64_t ldh, float *res, int64_t ldr, int64_t n)
{
    for (int64_t j = 0; j < D / VL; ++j) {
        const int64_t lanes = d - j * VL < VL ? d - j * VL : VL;
        const int64_t step = balanced(n, LSTM_RB);
        for (int64_t r0 = 0; r0 < n; r0 += step) {
            const int rb = (int)(n - r0 < step ? n - r0 : step);
            const float *a_ = a + r0 * lda, *w_ = w + j * 4 * VL, *g_ = gin ? gin + r0 * ldg + j * VL : 0;
            float *c_ = c + r0 * ldc + j * VL, *h_ = hout + r0 * ldh + j * VL, *s_ = res ? res + r0 * ldr + j * VL : 0;
#define LSTM_CASE(RB) case RB: lstm_block_rows(RB, a_, lda, w_, 4 * D, K, g_, ldg, d, lanes, c_, ldc, h_, ldh, s_, ldr); break;
            switch (rb) {
            LSTM_CASE(1) LSTM_CASE(2) LSTM_CASE(3) LSTM_CASE(4) LSTM_CASE(5)
            default: lstm_block_rows(6, a_, lda, w_, 4 * D, K, g_, ldg, d, lanes, c_, ldc, h_, ldh, s_, ldr); break;
            }
#undef LSTM_CASE
        }
    }
}

/* x (n, D) rows -> gain-only LayerNorm over their first d entries (the rest are zero) -> out (n, D) */
static void layer_norm_rows(const float *x, int64_t ldx, const float *g, float *out, int64_t ldo, int64_t n, int64_t D, int64_t d)
{
    const int64_t nv = D / VL, tail = d - (nv - 1) * VL;
    vf mask = vset(0.0f);
    for (int64_t i = 0; i < tail; ++i)
        mask[i] = 1.0f;
    for (int64_t r = 0; r < n; ++r) {
        const float *xr = x + r * ldx;
        vf s = vset(0.0f), q = vset(0.0f);
        for (int64_t v = 0; v < nv; ++v)
            s += vload(xr + v * VL);
        const float mean = vsum(s) / (float)d;
        for (int64_t v = 0; v < nv; ++v) {
            vf dv = vload(xr + v * VL) - mean;
            if (v == nv - 1)
                dv *= mask;
            q += dv * dv;
        }
        const float rstd = 1.0f / sqrtf(vsum(q) / (float)d + LN_EPS);
        for (int64_t v = 0; v < nv; ++v)
            vstore(out + r * ldo + v * VL, (vload(xr + v * VL) - mean) * rstd * vload(g + v * VL));
    }
}

/* log softmax(l)[y] for one row of 256 logits */
static float log_softmax_at(const float *l, int y)
{
    vf m = vload(l);
    for (int v = 1; v < VOCAB / VL; ++v)
        m = vmax(m, vload(l + v * VL));
    const float mx = vhmax(m);
    vf s = vset(0.0f);
    for (int v = 0; v < VOCAB / VL; ++v)
        s += vexp(vload(l + v * VL) - mx);
    return l[y] - mx - logf(vsum(s));
}

static int64_t round_up(int64_t n) { return (n + VL - 1) / VL * VL; }

/* d rounded up to the vector width: the padded width of the kernels' layouts */
int64_t padded_width(int64_t d) { return round_up(d); }

/* W^T of the g-scaled LSTM weights into rows [k0, k0 + d) of a Wx-layout matrix (rows of 4D): w (4d, d) row-major,
 * its g rows (2d .. 3d) multiplied by g_scale; out must be zeroed (padding stays zero) */
static void pack_gates(const float *w, int64_t d, float g_scale, float *out, int64_t k0)
{
    const int64_t D = round_up(d);
    for (int64_t q = 0; q < 4; ++q)
        for (int64_t u = 0; u < d; ++u) {
            const float *row = w + (q * d + u) * d, scale = q == 2 ? g_scale : 1.0f;
            float *col = out + k0 * 4 * D + (u / VL) * 4 * VL + q * VL + u % VL;
            for (int64_t k = 0; k < d; ++k)
                col[k * 4 * D] = row[k] * scale;
        }
}

/* W_hh^T (P, d, 4d), its g columns already scaled by 2, into the recurrence kernel's layout (P, D, 4D) */
void pack_recurrent(const float *w_hh_t, float *out, int64_t P, int64_t d)
{
    const int64_t D = round_up(d);
    memset(out, 0, (size_t)(P * D * 4 * D) * sizeof(float));
    for (int64_t p = 0; p < P; ++p) {
        float *o = out + p * D * 4 * D;
        const float *w = w_hh_t + p * d * 4 * d;                 /* (d, 4d): column q*d + u of row k */
        for (int64_t q = 0; q < 4; ++q)
            for (int64_t u = 0; u < d; ++u)
                for (int64_t k = 0; k < d; ++k)
                    o[k * 4 * D + (u / VL) * 4 * VL + q * VL + u % VL] = w[k * 4 * d + q * d + u];
    }
}

/* x[j] <- exp, sigmoid or GELU (kind 0, 1, 2) of x[j], j < n: the kernels' own pointwise functions, for tests */
void pointwise(int64_t kind, float *x, int64_t n)
{
    for (int64_t j = 0; j < n; j += VL) {
        const int64_t m = n - j < VL ? n - j : VL;
        const vf v = vload_part(x + j, m);
        vstore_part(x + j, kind == 0 ? vexp(v) : kind == 1 ? vsigmoid(v) : vgelu(v), m);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * expert_forward
 */
typedef struct {
    int64_t d, e, depth, wide, D, E, H;
    int64_t block0, block, g1, wx, g2, w1, w2;     /* block sections: offsets from the block's start */
    int64_t gf, pout, size;
} Shape;

static Shape shape_of(int64_t d, int64_t e, int64_t depth)
{
    Shape s = {.d = d, .e = e, .depth = depth, .wide = d != e, .D = round_up(d), .E = round_up(e), .H = round_up(4 * d)};
    s.block0 = s.wide ? s.E * s.D : 0;
    s.g1 = 0;
    s.wx = s.g1 + s.D;
    s.g2 = s.wx + 2 * s.D * 4 * s.D;
    s.w1 = s.g2 + s.D;
    s.w2 = s.w1 + s.D * s.H;
    s.block = s.w2 + s.H * s.D;
    s.gf = s.block0 + depth * s.block;
    s.pout = s.gf + s.D;
    s.size = s.pout + (s.wide ? s.D * s.E : 0);
    return s;
}

/* out (rows_out x cols_out, row stride ld) <- the transpose of w (cols x rows, row-major); out must be zeroed */
static void transpose_into(const float *w, int64_t rows, int64_t cols, float *out, int64_t ld)
{
    for (int64_t j = 0; j < cols; ++j)
        for (int64_t k = 0; k < rows; ++k)
            out[k * ld + j] = w[j * rows + k];
}

/* One copy's flat body -> its packed weights (layout at the top). off: the flat offsets in model.Layout's
 * order, proj_in (or -1), per block ln1, w_ih, w_hh, ln2, w1, w2, then lnf, proj_out (or -1). */
static void pack_body(const Shape *s, const float *body, const int64_t *off, float *out)
{
    const int64_t d = s->d, e = s->e, D = s->D, E = s->E, H = s->H;
    memset(out, 0, (size_t)s->size * sizeof(float));
    if (s->wide)
        transpose_into(body + off[0], e, d, out, D);                        /* proj_in (d, e) -> (E, D) */
    for (int64_t k = 0; k < s->depth; ++k) {
        const int64_t *o = off + 1 + 6 * k;
        float *blk = out + s->block0 + k * s->block;
        memcpy(blk + s->g1, body + o[0], (size_t)d * sizeof(float));
        pack_gates(body + o[1], d, 2.0f, blk + s->wx, 0);
        pack_gates(body + o[2], d, 2.0f, blk + s->wx, D);
        memcpy(blk + s->g2, body + o[3], (size_t)d * sizeof(float));
        transpose_into(body + o[4], d, 4 * d, blk + s->w1, H);              /* w1 (4d, d) -> (D, H) */
        transpose_into(body + o[5], 4 * d, d, blk + s->w2, D);              /* w2 (d, 4d) -> (H, D) */
    }
    memcpy(out + s->gf, body + off[1 + 6 * s->depth], (size_t)d * sizeof(float));
    if (s->wide)
        transpose_into(body + off[2 + 6 * s->depth], d, e, out + s->pout, E);   /* proj_out (e, d) -> (D, E) */
}

/* floats of one tile's buffers for `rows` rows */
static int64_t tile_floats(const Shape *s, int64_t rows)
{
    return rows * (s->D * (4 + 3 * s->depth) + s->H + s->E + VOCAB);
}

/* Rows r < n (one copy, one tile) through all T steps: x, y (n rows of stride ldx) bytes; the row sums of
 * -log p(target) for t >= t_first into nll, and log p itself into logp (rows of stride ldp) when given. */
static void expert_tile(const Shape *s, const float *restrict wts, const float *restrict head, const float *restrict head_t,
                        const uint8_t *x, const uint8_t *y, int64_t ldx, int64_t T, int64_t t_first, int64_t n,
                        float *logp, int64_t ldp, double *nll, float *buf, int64_t rows)
{
    const int64_t d = s->d, e = s->e, D = s->D, E = s->E, H = s->H;
    float *xs = buf, *hn = xs + rows * D, *u = hn + rows * D, *cat = u + rows * D;
    float *cs = cat + s->depth * rows * 2 * D, *hid = cs + s->depth * rows * D, *io = hid + rows * H, *lg = io + rows * E;
    memset(buf, 0, (size_t)tile_floats(s, rows) * sizeof(float));
    for (int64_t r = 0; r < n; ++r)
        nll[r] = 0.0;
    for (int64_t t = 0; t < T; ++t) {
        float *emb = s->wide ? io : xs;                        /* narrow: the embedding is the residual stream */
        const int64_t lde = s->wide ? E : D;
        for (int64_t r = 0; r < n; ++r)
            memcpy(emb + r * lde, head + (int64_t)x[r * ldx + t] * e, (size_t)e * sizeof(float));
        if (s->wide)
            mm(EPI_STORE, io, E, wts, D, E, D, n, xs, D);
        for (int64_t k = 0; k < s->depth; ++k) {
            const float *blk = wts + s->block0 + k * s->block;
            float *catk = cat + k * rows * 2 * D, *ck = cs + k * rows * D;   /* catk rows: [LN(x) | h] */
            layer_norm_rows(xs, D, blk + s->g1, catk, 2 * D, n, D, d);
            lstm_rows(catk, 2 * D, blk + s->wx, 2 * D, D, 0, 0, d, ck, D, hn, D, xs, D, n);
            for (int64_t r = 0; r < n; ++r)
                memcpy(catk + r * 2 * D + D, hn + r * D, (size_t)D * sizeof(float));
            layer_norm_rows(xs, D, blk + s->g2, u, D, n, D, d);
            mm(EPI_GELU, u, D, blk + s->w1, H, D, H, n, hid, H);
            mm(EPI_ADD, hid, H, blk + s->w2, D, H, D, n, xs, D);
        }
        if (t < t_first)
            continue;
        if (s->wide) {
            layer_norm_rows(xs, D, wts + s->gf, u, D, n, D, d);
            mm(EPI_STORE, u, D, wts + s->pout, E, D, E, n, io, E);
        } else {
            layer_norm_rows(xs, D, wts + s->gf, io, E, n, D, d);
        }
        mm(EPI_STORE, io, E, head_t, VOCAB, E, VOCAB, n, lg, VOCAB);
        for (int64_t r = 0; r < n; ++r) {
            const float lp = log_softmax_at(lg + r * VOCAB, y[r * ldx + t]);
            nll[r] -= (double)lp;
            if (logp)
                logp[r * ldp + t - t_first] = lp;
        }
    }
}

/* C copies of an expert over B rows of T bytes each.
 *   bodies   C pointers to flat bodies, off the offsets of their tensors (see pack_body)
 *   heads    H pointers to (256, e) byte embeddings / decoders
 *   x, y     bytes: row b of group g at g * ldg + b * ldx, T steps; copy i reads group i / (C / groups) and
 *            head (i / (C / groups)) % H
 *   sizes    when not null, the real rows of each group (groups entries, each <= B): rows b >= sizes[g] are
 *            padding, never computed, and their outputs are 0
 * Out: nll (C, B) the sums over t >= t_first of -log p(y), and when logp is not null, logp (C, B, T - t_first).
 * Tasks are (copy, tile of `rows` rows); a thread packs a copy's weights and a head's transpose when its task
 * needs another one than its last, and a task with no real rows packs nothing. */
void expert_forward(const float *const *bodies, const int64_t *off, const float *const *heads, int64_t n_heads,
                    const uint8_t *x, const uint8_t *y, int64_t ldx, int64_t ldg, int64_t groups, const int64_t *sizes,
                    float *logp, double *nll, int64_t C, int64_t B, int64_t T, int64_t t_first, int64_t d, int64_t e,
                    int64_t depth, int64_t rows)
{
    const Shape s = shape_of(d, e, depth);
    const int64_t tiles = (B + rows - 1) / rows, per = C / groups, ldp = T - t_first;
    const size_t tile_bytes = ((size_t)tile_floats(&s, rows) * sizeof(float) + 63) / 64 * 64;
    const size_t wts_bytes = ((size_t)s.size * sizeof(float) + 63) / 64 * 64, head_bytes = (size_t)(s.E * VOCAB) * sizeof(float);
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, tile_bytes), *wts = aligned_alloc(64, wts_bytes), *head_t = aligned_alloc(64, head_bytes);
        int64_t packed = -1, transposed = -1;
        memset(head_t, 0, head_bytes);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < C * tiles; ++task) {
            const int64_t i = task / tiles, r0 = (task % tiles) * rows, all = B - r0 < rows ? B - r0 : rows;
            const int64_t grp = i / per, hd = grp % n_heads, at = grp * ldg + r0 * ldx;
            const int64_t real = sizes ? sizes[grp] - r0 : all, n = real < 0 ? 0 : real < all ? real : all;
            for (int64_t r = n; r < all; ++r) {                       /* padding rows: outputs 0, nothing computed */
                nll[i * B + r0 + r] = 0.0;
                if (logp)
                    memset(logp + (i * B + r0 + r) * ldp, 0, (size_t)ldp * sizeof(float));
            }
            if (n == 0)
                continue;
            if (packed != i)
                pack_body(&s, bodies[i], off, wts), packed = i;
            if (transposed != hd)
                transpose_into(heads[hd], e, VOCAB, head_t, VOCAB), transposed = hd;   /* (256, e) -> (E, 256) */
            expert_tile(&s, wts, heads[hd], head_t, x + at, y + at, ldx, T, t_first, n, logp ? logp + (i * B + r0) * ldp : 0,
                        ldp, nll + i * B + r0, buf, rows);
        }
        free(buf);
        free(wts);
        free(head_t);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * lstm_block: the sequential part of a bias-free LSTM layer for the torch-composed path.
 *   gates_in (P, T, B, 4d)  x W_ih^T (g rows pre-scaled by 2), hoisted out of the time loop by the caller
 *   w        (P, D, 4D)     W_hh^T packed as Wx's lower half (fused.pack_recurrent)
 *   h, c     (P, B, d)      state, read and updated in place
 *   out      (P, T, B, d)   h at every step
 */
void lstm_block(const float *gates_in, const float *w, float *h, float *c, float *out, int64_t P, int64_t T, int64_t B,
                int64_t d, int64_t rows)
{
    const int64_t D = round_up(d), tiles = (B + rows - 1) / rows;
    const size_t bytes = ((size_t)(3 * rows * D) * sizeof(float) + 63) / 64 * 64;
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, bytes);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < P * tiles; ++task) {
            const int64_t p = task / tiles, r0 = (task % tiles) * rows, n = B - r0 < rows ? B - r0 : rows;
            float *hb = buf, *cb = hb + rows * D, *hn = cb + rows * D;
            memset(buf, 0, 3 * (size_t)(rows * D) * sizeof(float));
            for (int64_t r = 0; r < n; ++r) {
                memcpy(hb + r * D, h + (p * B + r0 + r) * d, (size_t)d * sizeof(float));
                memcpy(cb + r * D, c + (p * B + r0 + r) * d, (size_t)d * sizeof(float));
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t row0 = (p * T + t) * B + r0;
                lstm_rows(hb, D, w + p * D * 4 * D, D, D, gates_in + row0 * 4 * d, 4 * d, d, cb, D, hn, D, 0, 0, n);
                for (int64_t r = 0; r < n; ++r) {
                    memcpy(out + (row0 + r) * d, hn + r * D, (size_t)d * sizeof(float));
                    memcpy(hb + r * D, hn + r * D, (size_t)D * sizeof(float));
                }
            }
            for (int64_t r = 0; r < n; ++r) {
                memcpy(h + (p * B + r0 + r) * d, hb + r * D, (size_t)d * sizeof(float));
                memcpy(c + (p * B + r0 + r) * d, cb + r * D, (size_t)d * sizeof(float));
            }
        }
        free(buf);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * log p(y) under the byte decoder for C copies of R rows each: log softmax(h E^T)[y].
 *   h        (C, R, e)     decoder inputs (final hidden states)
 *   heads_t  (H, e, 256)   E^T of each head; copy i uses head (i / P) % H (H = 1: one shared head)
 *   y        (C / P, R)    target bytes; copy i uses row group i / P (P copies share targets)
 *   out      (C, R)
 * The 256 logits of a tile of rows stay in cache: no (rows, 256) tensor is ever written.
 */
#define DECODER_TILE 24
void target_logprobs(const float *h, const float *heads_t, const uint8_t *y, float *out, int64_t C, int64_t R, int64_t e,
                     int64_t P, int64_t H)
{
    const int64_t tiles = (R + DECODER_TILE - 1) / DECODER_TILE;
#pragma omp parallel
    {
        float *logits = aligned_alloc(64, DECODER_TILE * VOCAB * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < C * tiles; ++task) {
            const int64_t i = task / tiles, r0 = (task % tiles) * DECODER_TILE;
            const int64_t n = R - r0 < DECODER_TILE ? R - r0 : DECODER_TILE;
            mm(EPI_STORE, h + (i * R + r0) * e, e, heads_t + ((i / P) % H) * e * VOCAB, VOCAB, e, VOCAB, n, logits, VOCAB);
            for (int64_t r = 0; r < n; ++r)
                out[i * R + r0 + r] = log_softmax_at(logits + r * VOCAB, y[(i / P) * R + r0 + r]);
        }
        free(logits);
    }
}
