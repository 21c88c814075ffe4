/* kvtier: a small pool of persistent worker threads for the native kernels. */
#ifndef KVTIER_POOL_H
#define KVTIER_POOL_H

/* fn(ctx, a, b) runs over [a, b) of [0, n). */
typedef void (*kvtier_range_fn)(void* ctx, long a, long b);

/* Split [0, n) into `threads` contiguous parts of ceil(n / threads) (the
   caller runs the first, workers the rest) and return when all are done.
   Returns the parts used (fewer when n is smaller or a worker could not be
   started). Calls are serialized; a part's result must not depend on the
   split. */
int kvtier_parallel(int threads, long n, kvtier_range_fn fn, void* ctx);

#endif
