/* kvtier: the native kernels' worker pool (kvtier_pool.h).
 *
 * A decode step makes ~200 few-row products and a prefill chunk one softmax
 * per layer: too many calls to start threads for each. Workers are started
 * on first need and kept; every call wakes the ones it uses. Calls are
 * serialized by `call_mu` (MLX's CPU stream runs one op at a time; the lock
 * keeps any other caller correct).
 */
#include "kvtier_pool.h"

#include <pthread.h>
#include <stddef.h>

#define MAX_THREADS 16

typedef struct {
  long a, b;
} part_t;

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t start_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static part_t parts[MAX_THREADS];
static kvtier_range_fn job_fn = 0;
static void* job_ctx = 0;
static int workers = 0;      /* started workers (worker i runs parts[i + 1]) */
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
    kvtier_range_fn fn = job_fn;
    void* ctx = job_ctx;
    part_t p = parts[i + 1];
    pthread_mutex_unlock(&mu);
    fn(ctx, p.a, p.b);
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

int kvtier_parallel(int threads, long n, kvtier_range_fn fn, void* ctx) {
  pthread_once(&atfork_once, register_atfork);
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads > n) threads = n > 0 ? (int)n : 1;
  if (threads == 1) {
    fn(ctx, 0, n);
    return 1;
  }
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
  long per = (n + threads - 1) / threads;
  for (int i = 0; i < threads; i++) {
    long a = i * per > n ? n : i * per, b = a + per > n ? n : a + per;
    parts[i] = (part_t){a, b};
  }
  job_fn = fn;
  job_ctx = ctx;
  active = threads - 1;
  pending = threads - 1;
  if (pending > 0) {
    round_no++;
    pthread_cond_broadcast(&start_cv);
  }
  pthread_mutex_unlock(&mu);
  fn(ctx, parts[0].a, parts[0].b);
  pthread_mutex_lock(&mu);
  while (pending > 0) pthread_cond_wait(&done_cv, &mu);
  pthread_mutex_unlock(&mu);
  pthread_mutex_unlock(&call_mu);
  return threads;
}
