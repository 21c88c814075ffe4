/* kvtier: y = x @ w.T for a few input rows, reading each fp32 weight row once.
 *
 * x: M rows of K floats; w: N rows of K floats (row-major, as nn.Linear keeps
 * its weight); y: M rows of N floats. Each output element is one 8-lane
 * accumulator over k in order, then a fixed horizontal sum and a scalar tail:
 * the same arithmetic whatever M, the tiling or the thread split, so a row's
 * result does not depend on which other rows share the call (the batch lane
 * and the serial lane compute every row alike). AVX2 + FMA; the caller checks
 * the CPU before loading this code.
 */
#include <immintrin.h>

#include "kvtier_simd.h"
#include <pthread.h>
#include <stddef.h>

/* MM (a compile-time count, so the accumulators stay in registers) input rows
   against weight rows [n0, n1). */
#define ROWS(MM)                                                                          \
  static void rows##MM(const float* restrict x, const float* restrict w, float* restrict y, \
                       int K, int N, int n0, int n1) {                                    \
    for (int n = n0; n < n1; n++) {                                                       \
      const float* wr = w + (size_t)n * K;                                                \
      __m256 acc[MM];                                                                     \
      _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();   \
      int k = 0;                                                                          \
      for (; k + 8 <= K; k += 8) {                                                        \
        __m256 wv = _mm256_loadu_ps(wr + k);                                              \
        _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) acc[m] =                     \
            _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)m * K + k), wv, acc[m]);          \
      }                                                                                   \
      _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) {                              \
        float s = hsum(acc[m]);                                                           \
        for (int kk = k; kk < K; kk++) s += x[(size_t)m * K + kk] * wr[kk];               \
        y[(size_t)m * N + n] = s;                                                         \
      }                                                                                   \
    }                                                                                     \
  }
ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

typedef void (*rows_fn)(const float*, const float*, float*, int, int, int, int);
static const rows_fn ROWS_FN[5] = {0, rows1, rows2, rows3, rows4};

typedef struct {
  const float* x;
  const float* w;
  float* y;
  int M, K, N, n0, n1;
} job_t;

/* Weight rows in tiles that stay in the L2 cache while every block of up to 4
   input rows reads them: the weights come from memory once per call. */
#define TILE 32
static void run(const job_t* j) {
  for (int t0 = j->n0; t0 < j->n1; t0 += TILE) {
    int t1 = t0 + TILE < j->n1 ? t0 + TILE : j->n1;
    for (int m0 = 0; m0 < j->M; m0 += 4) {
      int mm = j->M - m0 < 4 ? j->M - m0 : 4;
      ROWS_FN[mm](j->x + (size_t)m0 * j->K, j->w, j->y + (size_t)m0 * j->N, j->K, j->N, t0, t1);
    }
  }
}

/* A small pool of persistent workers: a decode step makes ~200 calls, too many
   to create threads for each. Calls are serialized by `call_mu`. */
#define MAX_THREADS 16
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t start_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static job_t jobs[MAX_THREADS];
static int workers = 0;      /* started workers (thread i runs jobs[i + 1]) */
static int active = 0;       /* workers taking part in the current call */
static unsigned long round_no = 0;
static int pending = 0;

static void* worker(void* arg) {
  int i = (int)(size_t)arg;
  unsigned long seen = 0;
  pthread_mutex_lock(&mu);
  for (;;) {
    while (round_no == seen) pthread_cond_wait(&start_cv, &mu);
    seen = round_no;
    if (i >= active) continue;
    pthread_mutex_unlock(&mu);
    run(&jobs[i + 1]);
    pthread_mutex_lock(&mu);
    if (--pending == 0) pthread_cond_signal(&done_cv);
  }
  return 0;
}

/* A forked child has the parent's counters but none of its threads: start over. */
static void reset_in_child(void) {
  pthread_mutex_init(&call_mu, 0);
  pthread_mutex_init(&mu, 0);
  pthread_cond_init(&start_cv, 0);
  pthread_cond_init(&done_cv, 0);
  workers = 0;
  active = 0;
  pending = 0;
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(0, 0, reset_in_child); }

int kvtier_few_row_matmul(const float* x, const float* w, float* y, int M, int K, int N, int threads) {
  pthread_once(&atfork_once, register_atfork);
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads > N) threads = N > 0 ? N : 1;
  pthread_mutex_lock(&call_mu);
  pthread_mutex_lock(&mu);
  while (workers < threads - 1) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, worker, (void*)(size_t)workers) != 0) {
      pthread_attr_destroy(&attr);
      break;
    }
    pthread_attr_destroy(&attr);
    workers++;
  }
  if (threads - 1 > workers) threads = workers + 1;
  int per = (N + threads - 1) / threads;
  for (int i = 0; i < threads; i++) {
    int a = i * per > N ? N : i * per, b = a + per > N ? N : a + per;
    jobs[i] = (job_t){x, w, y, M, K, N, a, b};
  }
  active = threads - 1;
  pending = threads - 1;
  if (pending > 0) {
    round_no++;
    pthread_cond_broadcast(&start_cv);
  }
  pthread_mutex_unlock(&mu);
  run(&jobs[0]);
  pthread_mutex_lock(&mu);
  while (pending > 0) pthread_cond_wait(&done_cv, &mu);
  pthread_mutex_unlock(&mu);
  pthread_mutex_unlock(&call_mu);
  return threads;
}
