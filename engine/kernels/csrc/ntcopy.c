/* C helper source loaded by kvtransfer/rowcopy.py (streaming copies of KV block rows). */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define PAGE 4096

__attribute__((target("avx512f")))
static inline void copy256(uint8_t* d, const uint8_t* s) {
    __m512i a = _mm512_loadu_si512((const void*)s);
    __m512i b = _mm512_loadu_si512((const void*)(s + 64));
    __m512i c = _mm512_loadu_si512((const void*)(s + 128));
    __m512i e = _mm512_loadu_si512((const void*)(s + 192));
    _mm512_stream_si512((void*)d, a);
    _mm512_stream_si512((void*)(d + 64), b);
    _mm512_stream_si512((void*)(d + 128), c);
    _mm512_stream_si512((void*)(d + 192), e);
}

/* Streams up to 4 pages of the row side by side (as glibc's large memcpy does): more
   DRAM streams in flight than walking the row front to back. */
__attribute__((target("avx512f")))
static void row_avx512(uint8_t* d, const uint8_t* s, int64_t n) {
    if ((uintptr_t)d & 63) {
        int64_t k = 64 - (int64_t)((uintptr_t)d & 63);
        if (k > n) k = n;
        memcpy(d, s, k); d += k; s += k; n -= k;
    }
    while (n >= PAGE) {
        int64_t pages = n / PAGE < 4 ? n / PAGE : 4;
        for (int64_t k = 0; k < PAGE; k += 256)
            for (int64_t p = 0; p < pages; p++) copy256(d + p * PAGE + k, s + p * PAGE + k);
        d += pages * PAGE; s += pages * PAGE; n -= pages * PAGE;
    }
    for (; n >= 256; n -= 256, s += 256, d += 256) copy256(d, s);
    if (n) memcpy(d, s, n);
}

static void row_sse2(uint8_t* d, const uint8_t* s, int64_t n) {
    if ((uintptr_t)d & 15) {
        int64_t k = 16 - (int64_t)((uintptr_t)d & 15);
        if (k > n) k = n;
        memcpy(d, s, k); d += k; s += k; n -= k;
    }
    for (; n >= 64; n -= 64, s += 64, d += 64) {
        __m128i a = _mm_loadu_si128((const __m128i*)s);
        __m128i b = _mm_loadu_si128((const __m128i*)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i*)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i*)(s + 48));
        _mm_stream_si128((__m128i*)d, a);
        _mm_stream_si128((__m128i*)(d + 16), b);
        _mm_stream_si128((__m128i*)(d + 32), c);
        _mm_stream_si128((__m128i*)(d + 48), e);
    }
    if (n) memcpy(d, s, n);
}
#endif

/* For each of `pairs` (dst, src) matrices: dst[dst_ids[i]] = src[src_ids[i]], i < n. */
void pd_copy_rows(int64_t pairs, const int64_t* dsts, const int64_t* srcs,
                  const int64_t* dst_ids, const int64_t* src_ids, int64_t n,
                  int64_t row_bytes) {
#if defined(__x86_64__)
    int wide = __builtin_cpu_supports("avx512f");
#endif
    for (int64_t p = 0; p < pairs; p++) {
        uint8_t* dst = (uint8_t*)(uintptr_t)dsts[p];
        const uint8_t* src = (const uint8_t*)(uintptr_t)srcs[p];
        for (int64_t i = 0; i < n; i++) {
            uint8_t* d = dst + dst_ids[i] * row_bytes;
            const uint8_t* s = src + src_ids[i] * row_bytes;
#if defined(__x86_64__)
            if (wide) row_avx512(d, s, row_bytes); else row_sse2(d, s, row_bytes);
#else
            memcpy(d, s, row_bytes);
#endif
        }
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
}
