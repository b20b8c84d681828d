/* RepOps CPU kernels that torch would run as several passes over memory, fused into one or two.
 *
 * Each kernel computes exactly what its eager-torch counterpart in verify/repops/ops.py computes,
 * bit for bit: the same IEEE float32/float64 operations in the same order, one at a time. Built
 * with -ffp-contract=off (GCC's default for C fuses a * b + c into an FMA, which rounds once
 * instead of twice) and without -ffast-math; on x86-64 float arithmetic has no excess precision.
 * Vectorizing these loops changes no bit: no loop reduces in floating point in an order a
 * compiler could change (maxima are exact in any order; sums follow sum_tree's fixed levels,
 * each level an elementwise loop).
 *
 * A kernel returns 0 on success, or 1 when an input holds a value it leaves to torch (a NaN or
 * an infinity among the values a grid is bounded by), so that the caller runs the eager code.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define E_MIN (-100)

static inline float magic32(int e, int bits) {
    /* 1.5 * 2**(e + 23 - bits) from its float32 fields (see repops_ops._grid). */
    uint32_t word = ((uint32_t)(e + 150 - bits) << 23) | (1u << 22);
    float out;
    memcpy(&out, &word, sizeof out);
    return out;
}

static inline double magic64(int e, int bits) {
    return 1.5 * ldexp(1.0, e + 52 - bits);
}

/* Grid exponent of one row: frexp's exponent of max |x| (finite), at least E_MIN. */
static inline int exponent_of(float bound) {
    int e;
    frexpf(bound, &e);
    return e < E_MIN ? E_MIN : e;
}

static inline uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* One row (n elements, strides xs and os) onto the grid of exponent e. The float32 constant is
 * cheaper; both round to the same grid (see repops_ops._grid), so choosing by the data changes
 * no bit, but the float32 one would overflow near float32's largest magnitudes. */
static void round_row(const float *x, int64_t xs, double *out, int64_t os, int64_t n, int e,
                      int bits) {
    if (bits > 22 || e > 100) {
        const double m = magic64(e, bits);
        for (int64_t c = 0; c < n; c++) {
            double t = (double)x[c * xs] + m;
            out[c * os] = t - m;
        }
    } else if (xs == 1 && os == 1) {
        const float m = magic32(e, bits);
        for (int64_t c = 0; c < n; c++) {
            float t = x[c] + m;
            out[c] = (double)(t - m);
        }
    } else {
        const float m = magic32(e, bits);
        for (int64_t c = 0; c < n; c++) {
            float t = x[c * xs] + m;
            out[c * os] = (double)(t - m);
        }
    }
}

/* One (rows, cols) matrix of grid_rows; strides xs[2] and os[2] (row, column).
 *
 * Bounds are taken on the bit patterns of |x|: for non-negative floats integer order is float
 * order, and an integer maximum vectorizes where a float one (NaN rules) does not; a pattern at
 * or above infinity's is a NaN or an infinity. */
static int grid_matrix(const float *x, const int64_t *xs, double *out, const int64_t *os,
                       int64_t rows, int64_t cols, int bits, uint32_t *top, float *magic) {
    const uint32_t *pattern = (const uint32_t *)x;
    if (xs[0] != 1 || xs[1] == 1) {
        /* Row by row: its bound, then its rounding while the row is still in cache. */
        for (int64_t r = 0; r < rows; r++) {
            const uint32_t *row = pattern + r * xs[0];
            uint32_t m = 0;
            if (xs[1] == 1)
                for (int64_t c = 0; c < cols; c++) m = max_u32(m, row[c] & 0x7fffffffu);
            else
                for (int64_t c = 0; c < cols; c++) m = max_u32(m, row[c * xs[1]] & 0x7fffffffu);
            if (m >= 0x7f800000u) return 1;
            float bound;
            memcpy(&bound, &m, sizeof bound);
            round_row(x + r * xs[0], xs[1], out + r * os[0], os[1], cols, exponent_of(bound), bits);
        }
        return 0;
    }
    /* Rows side by side (each row strided, the rows contiguous): the inner loops run down the
     * contiguous axis with one bound and one constant per row. */
    for (int64_t r = 0; r < rows; r++) top[r] = 0;
    for (int64_t c = 0; c < cols; c++) {
        const uint32_t *col = pattern + c * xs[1];
        for (int64_t r = 0; r < rows; r++) top[r] = max_u32(top[r], col[r] & 0x7fffffffu);
    }
    int wide = bits > 22;
    for (int64_t r = 0; r < rows; r++) {
        if (top[r] >= 0x7f800000u) return 1;
        float bound;
        memcpy(&bound, &top[r], sizeof bound);
        int e = exponent_of(bound);
        wide |= e > 100;
        magic[r] = magic32(e, bits);
        top[r] = (uint32_t)e;
    }
    if (wide || os[0] != 1) {
        for (int64_t r = 0; r < rows; r++)
            round_row(x + r, xs[1], out + r * os[0], os[1], cols, (int)top[r], bits);
        return 0;
    }
    for (int64_t c = 0; c < cols; c++) {
        const float *col = x + c * xs[1];
        double *ocol = out + c * os[1];
        for (int64_t r = 0; r < rows; r++) {
            float t = col[r] + magic[r];
            ocol[r] = (double)(t - magic[r]);
        }
    }
    return 0;
}

/* out = x rounded half to even onto a per-row grid of 2**(e - bits), as float64.
 *
 * x is an (n0, n1, rows, cols) float32 view with element strides xs[4]; out is float64 with
 * strides os[4]. The grid of a row is set by the largest magnitude in that row (reduction over
 * cols). `top` and `magic` are scratch of `rows` elements each. The caller transposes views so
 * that the reduced axis is always the last. */
int grid_rows(const float *x, const int64_t *xs, double *out, const int64_t *os, int64_t n0,
              int64_t n1, int64_t rows, int64_t cols, int bits, uint32_t *top, float *magic) {
    for (int64_t i = 0; i < n0; i++)
        for (int64_t j = 0; j < n1; j++)
            if (grid_matrix(x + i * xs[0] + j * xs[1], xs + 2, out + i * os[0] + j * os[1], os + 2,
                            rows, cols, bits, top, magic))
                return 1;
    return 0;
}

/* out = float32(x) + 0.0f (+ bias[col] when bias is given), for contiguous (rows, cols). */
int to_f32(const double *x, float *out, int64_t rows, int64_t cols, const float *bias) {
    if (bias == NULL) {
        int64_t n = rows * cols;
        for (int64_t i = 0; i < n; i++) {
            float t = (float)x[i];
            out[i] = t + 0.0f;
        }
        return 0;
    }
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * cols;
        float *orow = out + r * cols;
        for (int64_t c = 0; c < cols; c++) {
            float t = (float)xr[c];
            t = t + 0.0f;
            orow[c] = t + bias[c];
        }
    }
    return 0;
}

/* ---- elementwise chains and row kernels (repops_ops.exp, erf, softmax_rows, GELU) ----------
 *
 * `k` holds the float32 constants of repops_ops, in repops_ops.NATIVE_CONSTANTS's order (passed in,
 * so that both paths round the same Python floats the same way). These kernels return 1 on a
 * NaN input: float-to-int conversion of a NaN differs between torch and C. */
enum { EXP_LO, EXP_HI, LOG2E, EXP_C1, EXP_C2, EXP_P, ERF_N = EXP_P + 6, ERF_D = ERF_N + 7,
       INV_SQRT2 = ERF_D + 5, INV_SQRT_2PI, N_CONSTANTS };

static inline float clampf(float x, float lo, float hi) {
    /* torch.clamp: NaN stays NaN (never reached here), else min(max(x, lo), hi). */
    x = x < lo ? lo : x;
    return x > hi ? hi : x;
}

static inline float exp_r(float x, const float *k) {
    float xc = clampf(x, k[EXP_LO], k[EXP_HI]);
    float n = rintf(xc * k[LOG2E]); /* half to even, as torch.round */
    float r = xc - n * k[EXP_C1];   /* n * C1 is exact */
    r = r - n * k[EXP_C2];
    float z = r * r;
    float p = r * k[EXP_P] + k[EXP_P + 1];
    for (int i = 2; i < 6; i++) p = p * r + k[EXP_P + i];
    p = p * z;
    p = p + r;
    p = p + 1.0f;
    int32_t word;
    memcpy(&word, &p, sizeof word);
    word += (int32_t)n * (1 << 23);
    memcpy(&p, &word, sizeof p);
    return x < k[EXP_LO] ? 0.0f : p;
}

static inline float erf_r(float x, const float *k) {
    float z = clampf(x, -4.0f, 4.0f);
    float z2 = z * z;
    float p = z2 * k[ERF_N] + k[ERF_N + 1];
    for (int i = 2; i < 7; i++) p = p * z2 + k[ERF_N + i];
    float q = z2 * k[ERF_D] + k[ERF_D + 1];
    for (int i = 2; i < 5; i++) q = q * z2 + k[ERF_D + i];
    p = p * z;
    return p / q;
}

static int any_nan(const float *x, int64_t n) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= x[i] != x[i];
    return bad;
}

/* out = repops_ops.exp(x), elementwise (SiLU, log-softmax and their backward call it). */
int exp_vec(const float *x, float *out, int64_t n, const float *k) {
    if (any_nan(x, n)) return 1;
    for (int64_t i = 0; i < n; i++) out[i] = exp_r(x[i], k);
    return 0;
}

/* out = erf(x * INV_SQRT2) * 0.5 + 0.5 (repops_ops._gelu_cdf). */
int gelu_cdf(const float *x, float *out, int64_t n, const float *k) {
    if (any_nan(x, n)) return 1;
    for (int64_t i = 0; i < n; i++) {
        float e = erf_r(x[i] * k[INV_SQRT2], k);
        e = e * 0.5f;
        out[i] = e + 0.5f;
    }
    return 0;
}

static inline float gelu_cdf_r(float x, const float *k) {
    float e = erf_r(x * k[INV_SQRT2], k);
    e = e * 0.5f;
    return e + 0.5f;
}

/* out = x * cdf(x): the exact GELU (verify.dispatch's aten.gelu, torch.mul(x, gelu_cdf(x))). */
int gelu_vec(const float *x, float *out, int64_t n, const float *k) {
    if (any_nan(x, n)) return 1;
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * gelu_cdf_r(x[i], k);
    return 0;
}

/* (exp(x * x * -0.5) * INV_SQRT_2PI * x + cdf) * dy (repops_ops._gelu_grad_rows), one element. */
static inline float gelu_grad_r(float x, float cdf, float dy, const float *k) {
    float s = x * x;
    s = s * -0.5f;
    float pdf = exp_r(s, k) * k[INV_SQRT_2PI];
    pdf = pdf * x;
    pdf = pdf + cdf;
    return pdf * dy;
}

/* gelu_backward below with the cdf computed in the same pass (aten.gelu_backward's mapping). */
int gelu_backward_x(const float *x, const float *dy, float *out, int64_t n, const float *k) {
    if (any_nan(x, n)) return 1;
    for (int64_t i = 0; i < n; i++) out[i] = gelu_grad_r(x[i], gelu_cdf_r(x[i], k), dy[i], k);
    return 0;
}

/* out = gelu_grad_r of each element, the cdf given. */
int gelu_backward(const float *x, const float *cdf, const float *dy, float *out, int64_t n,
                  const float *k) {
    if (any_nan(x, n)) return 1;
    for (int64_t i = 0; i < n; i++) out[i] = gelu_grad_r(x[i], cdf[i], dy[i], k);
    return 0;
}

/* repops_ops.sum_tree of buf[0..n) (n >= 1), destroying buf: level by level the first half is
 * added to the second, an odd last term carried to the next level. */
static float sum_tree(float *buf, int64_t n) {
    while (n > 1) {
        int64_t half = n / 2;
        for (int64_t i = 0; i < half; i++) buf[i] = buf[i] + buf[i + half];
        if (n % 2) {
            buf[half] = buf[n - 1];
            n = half + 1;
        } else {
            n = half;
        }
    }
    return buf[0];
}

/* Softmax of each row of contiguous (rows, cols) x into out (repops_ops.softmax_rows). With
 * `scale` != 0 each row is first multiplied by it, and with `causal` > 0 entries past the row's
 * position (row index modulo causal, the rows numbered from row0: a thread's share of a
 * matrix) are -inf first (repops_ops._attention_probs). With `safe`, a row whose entries are
 * all -inf is 0 (torch's _safe_softmax; plain softmax makes it NaN). `buf` is scratch of cols
 * floats. */
int softmax_rows(const float *x, float *out, int64_t rows, int64_t cols, float scale,
                 int64_t causal, int64_t row0, int safe, const float *k, float *buf) {
    if (any_nan(x, rows * cols)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float *orow = out + r * cols;
        int64_t live = causal > 0 ? ((row0 + r) % causal) + 1 : cols;
        if (live > cols) live = cols;
        for (int64_t c = 0; c < live; c++) orow[c] = scale != 0.0f ? row[c] * scale : row[c];
        for (int64_t c = live; c < cols; c++) orow[c] = -INFINITY;
        float top = orow[0];
        for (int64_t c = 1; c < cols; c++) top = orow[c] > top ? orow[c] : top;
        if (safe && top == -INFINITY) { /* every entry -inf: torch's _safe_softmax gives 0s */
            for (int64_t c = 0; c < cols; c++) orow[c] = 0.0f;
            continue;
        }
        top = top + 0.0f;
        for (int64_t c = 0; c < cols; c++) {
            float e = exp_r(orow[c] - top, k);
            orow[c] = e;
            buf[c] = e;
        }
        float total = sum_tree(buf, cols);
        for (int64_t c = 0; c < cols; c++) orow[c] = orow[c] / total;
    }
    return 0;
}

/* (dp - sum_tree(dp * p)) * p * scale per row (repops_ops._scores_grad_rows). */
int scores_grad_rows(const float *dp, const float *p, float *out, int64_t rows, int64_t cols,
                     float scale, float *buf) {
    if (any_nan(dp, rows * cols)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *d = dp + r * cols, *pr = p + r * cols;
        float *o = out + r * cols;
        for (int64_t c = 0; c < cols; c++) buf[c] = d[c] * pr[c];
        float row = sum_tree(buf, cols);
        for (int64_t c = 0; c < cols; c++) {
            float t = d[c] - row;
            t = t * pr[c];
            o[c] = t * scale;
        }
    }
    return 0;
}

/* ---- AdamW, one parameter tensor in one pass (repops_ops.adamw_) ------------------------------
 *
 * In place over n elements, with c = {beta1, 1 - beta1, beta2, 1 - beta2, sqrt(bias_correction2),
 * eps, 1 - lr * weight_decay, lr / bias_correction1} as float32 (repops_ops.adamw_constants):
 *   m = m * beta1 + g * (1 - beta1);  v = v * beta2 + (g * g) * (1 - beta2)
 *   p = p * decay - (m / (sqrt(v) / sqrt(bc2) + eps)) * step_size
 * sqrtf is IEEE's correctly rounded square root (as repops_ops.sqrt). Block by block, a block
 * whose p, g, m or v holds a NaN or an infinity stops the kernel before it writes that block:
 * the return value is the number of elements done (n when all were), and the caller runs the
 * eager code from there (the elements are independent, so the split changes no bit). */
#define ADAMW_BLOCK 256

static int any_nonfinite(const float *x, int64_t n) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (bits[i] & 0x7f800000u) == 0x7f800000u;
    return bad != 0;
}

int64_t adamw(float *p, const float *g, float *m, float *v, int64_t n, const float *c) {
    const float b1 = c[0], nb1 = c[1], b2 = c[2], nb2 = c[3], bc2 = c[4], eps = c[5];
    const float decay = c[6], step_size = c[7];
    for (int64_t start = 0; start < n; start += ADAMW_BLOCK) {
        int64_t len = n - start < ADAMW_BLOCK ? n - start : ADAMW_BLOCK;
        float *pb = p + start, *mb = m + start, *vb = v + start;
        const float *gb = g + start;
        if (any_nonfinite(pb, len) || any_nonfinite(gb, len) || any_nonfinite(mb, len) ||
            any_nonfinite(vb, len))
            return start;
        for (int64_t i = 0; i < len; i++) {
            float gi = gb[i];
            float mi = mb[i] * b1;
            mi = mi + gi * nb1;
            float g2 = gi * gi;
            float vi = vb[i] * b2;
            vi = vi + g2 * nb2;
            float denom = sqrtf(vi) / bc2;
            denom = denom + eps;
            float t = mi / denom;
            t = t * step_size;
            float pi = pb[i] * decay;
            pb[i] = pi - t;
            mb[i] = mi;
            vb[i] = vi;
        }
    }
    return n;
}

/* ---- trees over a strided axis, LayerNorm rows (repops_ops.sum_tree, _layernorm_*) ---------- */

/* out[r] = repops_ops.sum_tree over k of x[r * rs + k * ks] (R sums of K >= 2 terms each). The
 * tree's levels run over lines of R partial sums in buf (R * ceil(K / 2) floats): each level adds
 * the second half of the lines to the first, the inner loops run over r, contiguous, and every
 * sum sees the same additions in the same order as the row-at-a-time tree. */
int sum_tree_axis(const float *x, int64_t rs, int64_t ks, int64_t rows, int64_t k, float *out,
                  float *buf) {
    /* The first level reads x itself: line j = term j + term j + k/2, the odd last term carried.
     * A NaN among the terms leaves a NaN in its line (NaN + y is NaN), which the check sees. */
    int64_t half = k / 2, n = half + k % 2;
    for (int64_t j = 0; j < n; j++) {
        float *line = buf + j * rows;
        const float *a = x + j * ks, *b = x + (j + half) * ks;
        if (j == half) /* k odd: the last term, carried */
            for (int64_t r = 0; r < rows; r++) line[r] = x[(k - 1) * ks + r * rs];
        else if (rs == 1)
            for (int64_t r = 0; r < rows; r++) line[r] = a[r] + b[r];
        else
            for (int64_t r = 0; r < rows; r++) line[r] = a[r * rs] + b[r * rs];
    }
    if (any_nan(buf, rows * n)) return 1;
    while (n > 1) {
        int64_t half = n / 2;
        for (int64_t j = 0; j < half; j++) {
            float *a = buf + j * rows;
            const float *b = buf + (j + half) * rows;
            for (int64_t r = 0; r < rows; r++) a[r] = a[r] + b[r];
        }
        if (n % 2) {
            memcpy(buf + half * rows, buf + (n - 1) * rows, (size_t)rows * sizeof(float));
            n = half + 1;
        } else {
            n = half;
        }
    }
    memcpy(out, buf, (size_t)rows * sizeof(float));
    return 0;
}

/* LayerNorm statistics of each row of contiguous (rows, cols): stats[2r] = sum_tree(x) / d,
 * stats[2r + 1] = 1 / sqrt(sum_tree((x - mean)^2) / d + eps) (repops_ops._layernorm_stats).
 * buf: cols floats. */
int layernorm_stats(const float *x, int64_t rows, int64_t cols, float eps, float *stats,
                    float *buf) {
    if (any_nan(x, rows * cols)) return 1;
    const float d = (float)cols;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        memcpy(buf, row, (size_t)cols * sizeof(float));
        float mean = sum_tree(buf, cols) / d;
        for (int64_t c = 0; c < cols; c++) {
            float t = row[c] - mean;
            buf[c] = t * t;
        }
        float var = sum_tree(buf, cols) / d;
        var = var + eps;
        stats[2 * r] = mean;
        stats[2 * r + 1] = 1.0f / sqrtf(var);
    }
    return 0;
}

/* y = (x - mean) * rstd * g + b per row (repops_ops._layernorm). */
int layernorm_apply(const float *x, const float *stats, const float *g, const float *b,
                    int64_t rows, int64_t cols, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float *out = y + r * cols;
        const float mean = stats[2 * r], rstd = stats[2 * r + 1];
        for (int64_t c = 0; c < cols; c++) {
            float t = row[c] - mean;
            t = t * rstd;
            t = t * g[c];
            out[c] = t + b[c];
        }
    }
    return 0;
}

/* dx per row (repops_ops._layernorm_backward): xhat = (x - mean) * rstd, dxhat = dy * g,
 * a = sum_tree(dxhat) / d, c = sum_tree(dxhat * xhat) / d, dx = ((dxhat - a) - xhat * c) * rstd.
 * buf: 3 * cols floats. */
int layernorm_backward(const float *x, const float *stats, const float *g, const float *dy,
                       int64_t rows, int64_t cols, float *dx, float *buf) {
    if (any_nan(x, rows * cols) || any_nan(dy, rows * cols)) return 1;
    const float d = (float)cols;
    float *xhat = buf, *dxhat = buf + cols, *tree = buf + 2 * cols;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols, *dyr = dy + r * cols;
        const float mean = stats[2 * r], rstd = stats[2 * r + 1];
        for (int64_t c = 0; c < cols; c++) {
            float t = row[c] - mean;
            xhat[c] = t * rstd;
            dxhat[c] = dyr[c] * g[c];
            tree[c] = dxhat[c];
        }
        float a = sum_tree(tree, cols) / d;
        for (int64_t c = 0; c < cols; c++) tree[c] = dxhat[c] * xhat[c];
        float cc = sum_tree(tree, cols) / d;
        float *out = dx + r * cols;
        for (int64_t c = 0; c < cols; c++) {
            float t = dxhat[c] - a;
            float u = xhat[c] * cc;
            t = t - u;
            out[c] = t * rstd;
        }
    }
    return 0;
}

/* prod = (x - mean) * rstd * dy per row (repops_ops._layernorm_grad_weight's terms). */
int layernorm_xhat_dy(const float *x, const float *stats, const float *dy, int64_t rows,
                      int64_t cols, float *prod) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols, *dyr = dy + r * cols;
        float *out = prod + r * cols;
        const float mean = stats[2 * r], rstd = stats[2 * r + 1];
        for (int64_t c = 0; c < cols; c++) {
            float t = row[c] - mean;
            t = t * rstd;
            out[c] = t * dyr[c];
        }
    }
    return 0;
}

/* One kernel call cut into ranges, run by OpenMP's threads: the library links libgomp.so.1,
 * the runtime torch has already loaded, so the ranges go to torch's own worker threads (spinning
 * after its last parallel region) and never wait for a core one of them holds, as a second pool
 * did (verify/repops/split.py). Each range's arguments are SLOTS slots, in the kernel's order:
 * pointers and integers as int64, float parameters as double. KERNELS in split.py names the
 * kernel numbers. Returns each range's return value in codes. Only built with OpenMP: without
 * it the library has no run_ranges and every call runs whole. */
#ifdef _OPENMP
typedef union {
    int64_t i;
    double d;
} slot_t;

#define SLOTS 12
#define P(k) ((void *)(intptr_t)a[k].i)

static int64_t call_kernel(int kernel, const slot_t *a) {
    switch (kernel) {
    case 0:
        return grid_rows(P(0), P(1), P(2), P(3), a[4].i, a[5].i, a[6].i, a[7].i, (int)a[8].i,
                         P(9), P(10));
    case 1: return to_f32(P(0), P(1), a[2].i, a[3].i, P(4));
    case 2: return exp_vec(P(0), P(1), a[2].i, P(3));
    case 3: return gelu_cdf(P(0), P(1), a[2].i, P(3));
    case 4: return gelu_backward(P(0), P(1), P(2), P(3), a[4].i, P(5));
    case 5: return gelu_vec(P(0), P(1), a[2].i, P(3));
    case 6: return gelu_backward_x(P(0), P(1), P(2), a[3].i, P(4));
    case 7:
        return softmax_rows(P(0), P(1), a[2].i, a[3].i, (float)a[4].d, a[5].i, a[6].i,
                            (int)a[7].i, P(8), P(9));
    case 8: return scores_grad_rows(P(0), P(1), P(2), a[3].i, a[4].i, (float)a[5].d, P(6));
    case 9: return adamw(P(0), P(1), P(2), P(3), a[4].i, P(5));
    case 10: return sum_tree_axis(P(0), a[1].i, a[2].i, a[3].i, a[4].i, P(5), P(6));
    case 11: return layernorm_stats(P(0), a[1].i, a[2].i, (float)a[3].d, P(4), P(5));
    case 12: return layernorm_apply(P(0), P(1), P(2), P(3), a[4].i, a[5].i, P(6));
    case 13: return layernorm_backward(P(0), P(1), P(2), P(3), a[4].i, a[5].i, P(6), P(7));
    case 14: return layernorm_xhat_dy(P(0), P(1), P(2), a[3].i, a[4].i, P(5));
    default: return -1;
    }
}

int run_ranges(int kernel, int ranges, const slot_t *args, int64_t *codes) {
#pragma omp parallel for schedule(static, 1) num_threads(ranges)
    for (int r = 0; r < ranges; r++) codes[r] = call_kernel(kernel, args + (int64_t)r * SLOTS);
    return 0;
}
#endif
