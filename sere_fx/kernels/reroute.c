/* CPU kernel for sere.reroute (see sere_fx/ops.py for the op's definition and
 * sere_fx/kernels/reroute_cpu.py for how it is built and called).
 *
 * At decode sizes (T = 32 tokens, K = 8 slots, E = 128 experts) the op's arithmetic is a few
 * thousand operations; what costs is overhead. This kernel does it in one pass with no
 * allocation beyond two E-sized stack arrays:
 *   1. primary[e]: experts among each valid row's S best-ranked slots (descending rank value,
 *      ties to the lower slot; K <= MAX_SLOTS), and every expert of a free row (free rows
 *      that are also valid count as valid);
 *   2. per slot of a valid row whose expert e is not primary: the remap table entry of e, made
 *      on first use: the first primary expert in e's candidates (all experts sorted by
 *      similarity to e, descending, ties to the lower index: so the first primary one is
 *      argmax over primaries with the lowest index among ties), kept as e when
 *      similarity[e, best] < rho (rho > 0) or when there is no primary expert at all;
 *   3. ids outside [0, E) and rows that are not valid are copied unchanged.
 * rho is compared in float32, like every other back-end.
 */
#include <stdint.h>
#include <string.h>

#define MAX_EXPERTS 8192
#define MAX_SLOTS 64 /* the slots taken so far fit one 64-bit mask */

#define DEFINE_REROUTE(NAME, ID_T)                                                              \
int NAME(const ID_T *ids, ID_T *out, int64_t T, int64_t K, int64_t E, int64_t S,             \
         const float *sim, const int32_t *cand, float rho, const float *rank,                 \
         const uint8_t *valid, const uint8_t *free_rows) {                                     \
    if (E > MAX_EXPERTS || K > MAX_SLOTS) return -1;                                           \
    uint8_t primary[MAX_EXPERTS];                                                              \
    int32_t table[MAX_EXPERTS];                                                                \
    memset(primary, 0, (size_t)E);                                                             \
    int any = 0;                                                                               \
    for (int64_t t = 0; t < T; ++t) {                                                          \
        const ID_T *row = ids + t * K;                                                         \
        if (valid == 0 || valid[t]) {                                                          \
            if (rank == 0) { /* slot order is rank order */                                    \
                for (int64_t j = 0; j < S && j < K; ++j) {                                     \
                    int64_t e = (int64_t)row[j];                                               \
                    if (e >= 0 && e < E) { primary[e] = 1; any = 1; }                          \
                }                                                                              \
                continue;                                                                      \
            }                                                                                  \
            /* S passes of "best slot not taken yet" (ties: the lower slot): O(S K), S small */ \
            const float *r = rank + t * K;                                                     \
            uint64_t taken = 0;                                                                \
            for (int64_t s = 0; s < S && s < K; ++s) {                                         \
                int64_t best = -1;                                                             \
                for (int64_t j = 0; j < K; ++j)                                                \
                    if (!((taken >> j) & 1) && (best < 0 || r[j] > r[best])) best = j;         \
                taken |= (uint64_t)1 << best;                                                  \
                int64_t e = (int64_t)row[best];                                                \
                if (e >= 0 && e < E) { primary[e] = 1; any = 1; }                              \
            }                                                                                  \
        } else if (free_rows && free_rows[t]) {                                                \
            for (int64_t j = 0; j < K; ++j) {                                                  \
                int64_t e = (int64_t)row[j];                                                   \
                if (e >= 0 && e < E) { primary[e] = 1; any = 1; }                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    memcpy(out, ids, (size_t)(T * K) * sizeof(ID_T));                                          \
    if (!any) return 0; /* nothing to re-route to */                                            \
    for (int64_t e = 0; e < E; ++e) table[e] = -1; /* -1: not made yet */                       \
    for (int64_t t = 0; t < T; ++t) {                                                          \
        if (valid && !valid[t]) continue;                                                      \
        for (int64_t j = 0; j < K; ++j) {                                                      \
            int64_t e = (int64_t)ids[t * K + j];                                               \
            if (e < 0 || e >= E || primary[e]) continue;                                       \
            if (table[e] < 0) {                                                                \
                const int32_t *c = cand + e * E;                                               \
                int64_t n = 0;                                                                 \
                while (!primary[c[n]]) ++n; /* ends: some expert is primary */                 \
                int32_t best = c[n];                                                           \
                table[e] = (rho > 0.0f && sim[e * E + best] < rho) ? (int32_t)e : best;        \
            }                                                                                  \
            out[t * K + j] = (ID_T)table[e];                                                   \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_REROUTE(sere_reroute_i32, int32_t)
DEFINE_REROUTE(sere_reroute_i64, int64_t)

/* G independent calls of T rows each, stacked ([G, T, K] ids, [G, T, K] rank values, [G, T] valid
 * and free rows): the op's batching rule (many small decode batches routed at once) in one call
 * instead of G, each group by the kernel above. */
#define DEFINE_REROUTE_GROUPS(NAME, ONE, ID_T)                                                  \
int NAME(const ID_T *ids, ID_T *out, int64_t G, int64_t T, int64_t K, int64_t E, int64_t S,  \
         const float *sim, const int32_t *cand, float rho, const float *rank,                 \
         const uint8_t *valid, const uint8_t *free_rows) {                                     \
    for (int64_t g = 0; g < G; ++g) {                                                          \
        int rc = ONE(ids + g * T * K, out + g * T * K, T, K, E, S, sim, cand, rho,             \
                     rank ? rank + g * T * K : 0, valid ? valid + g * T : 0,                   \
                     free_rows ? free_rows + g * T : 0);                                       \
        if (rc) return rc;                                                                     \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_REROUTE_GROUPS(sere_reroute_groups_i32, sere_reroute_i32, int32_t)
DEFINE_REROUTE_GROUPS(sere_reroute_groups_i64, sere_reroute_i64, int64_t)

int sere_max_experts(void) { return MAX_EXPERTS; }
int sere_max_slots(void) { return MAX_SLOTS; }
