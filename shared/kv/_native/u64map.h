/*
 * A u64 -> u64 hash map for the compiled KV core (kvcore.c: the index's tables; schedcore.c: the
 * router's active blocks per worker). Header-only so each user inlines its hot paths.
 */
#ifndef DYNAMOD_U64MAP_H
#define DYNAMOD_U64MAP_H

#include <Python.h>
#include <stdint.h>

#define MAX_LOAD_NUM 7 /* maps grow beyond 70 % load */
#define MAX_LOAD_DEN 10

/* A u64 -> u64 hash map: open addressing, linear probing, backward-shift deletion (no
 * tombstones, so churn never degrades it). Key 0 marks an empty slot; the entry for key 0 itself
 * lives beside the table. */

typedef struct {
    uint64_t key, val;
} Slot;

typedef struct {
    Slot *slots;
    uint64_t mask; /* capacity - 1; capacity is a power of two */
    uint64_t count; /* entries in slots (key 0 excluded) */
    int shift;
    int has_zero;
    uint64_t zero_val;
} Map;

static inline uint64_t map_home(const Map *m, uint64_t k) {
    /* Fibonacci hashing: engine hashes may be small or sequential, node ids are sequential. */
    return (k * 0x9E3779B97F4A7C15ULL) >> m->shift;
}

static inline int map_init(Map *m, int bits) {
    m->slots = PyMem_Calloc((size_t)1 << bits, sizeof(Slot));
    if (m->slots == NULL) return -1;
    m->mask = ((uint64_t)1 << bits) - 1;
    m->shift = 64 - bits;
    m->count = 0;
    m->has_zero = 0;
    m->zero_val = 0;
    return 0;
}

static inline void map_free(Map *m) {
    PyMem_Free(m->slots);
    m->slots = NULL;
    m->count = 0;
    m->has_zero = 0;
}

static inline uint64_t map_len(const Map *m) { return m->count + (uint64_t)m->has_zero; }

static inline int map_get(const Map *m, uint64_t k, uint64_t *val) {
    if (k == 0) {
        *val = m->zero_val;
        return m->has_zero;
    }
    uint64_t i = map_home(m, k);
    for (;;) {
        uint64_t sk = m->slots[i].key;
        if (sk == k) {
            *val = m->slots[i].val;
            return 1;
        }
        if (sk == 0) return 0;
        i = (i + 1) & m->mask;
    }
}

static inline int map_grow(Map *m) {
    Map bigger;
    int bits = 64 - m->shift + 1;
    if (map_init(&bigger, bits) < 0) return -1;
    for (uint64_t i = 0; i <= m->mask; i++) {
        uint64_t k = m->slots[i].key;
        if (k == 0) continue;
        uint64_t j = map_home(&bigger, k);
        while (bigger.slots[j].key) j = (j + 1) & bigger.mask;
        bigger.slots[j] = m->slots[i];
    }
    bigger.count = m->count;
    bigger.has_zero = m->has_zero;
    bigger.zero_val = m->zero_val;
    PyMem_Free(m->slots);
    *m = bigger;
    return 0;
}

/* Inserts or overwrites. -1 on memory error (with the exception set). */
static inline int map_put(Map *m, uint64_t k, uint64_t v) {
    if (k == 0) {
        m->has_zero = 1;
        m->zero_val = v;
        return 0;
    }
    uint64_t i = map_home(m, k);
    for (;;) {
        uint64_t sk = m->slots[i].key;
        if (sk == k) {
            m->slots[i].val = v;
            return 0;
        }
        if (sk == 0) break;
        i = (i + 1) & m->mask;
    }
    if ((m->count + 1) * MAX_LOAD_DEN > (m->mask + 1) * MAX_LOAD_NUM) {
        if (map_grow(m) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        i = map_home(m, k);
        while (m->slots[i].key) i = (i + 1) & m->mask;
    }
    m->slots[i].key = k;
    m->slots[i].val = v;
    m->count++;
    return 0;
}

static inline int map_del(Map *m, uint64_t k, uint64_t *val) {
    if (k == 0) {
        if (!m->has_zero) return 0;
        if (val) *val = m->zero_val;
        m->has_zero = 0;
        return 1;
    }
    uint64_t i = map_home(m, k);
    for (;;) {
        uint64_t sk = m->slots[i].key;
        if (sk == k) break;
        if (sk == 0) return 0;
        i = (i + 1) & m->mask;
    }
    if (val) *val = m->slots[i].val;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        uint64_t sk = m->slots[j].key;
        if (sk == 0) break;
        uint64_t home = map_home(m, sk);
        /* Move j back into the hole at i unless its home lies cyclically in (i, j]. */
        if (((j - home) & m->mask) >= ((j - i) & m->mask)) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].key = 0;
    m->count--;
    return 1;
}

/* Empties the map and shrinks it back to a small table. */
static inline int map_reset(Map *m) {
    map_free(m);
    return map_init(m, 4);
}

static inline size_t map_bytes(const Map *m) { return m->slots ? (size_t)(m->mask + 1) * sizeof(Slot) : 0; }

#endif /* DYNAMOD_U64MAP_H */
