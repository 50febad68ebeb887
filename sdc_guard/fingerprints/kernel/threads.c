/* The threads every pass of the kernel splits its work over (common.h).

   Built with OpenMP (native.build: -fopenmp, linked against the libgomp torch loaded),
   the jobs run on torch's own OpenMP pool: right after a parallel torch op its workers
   still spin, waiting for the next parallel region, and this is one. Threads of our own
   would share the cores with those spinning workers instead. Without OpenMP, or in a
   process forked from the one that loaded the library (libgomp's pool does not survive a
   fork: a parallel region there waits forever for workers that were not copied), each
   pass starts threads of its own. Either way a job computes the same thing whichever
   thread runs it, and the callers combine the jobs' results in job order: the values
   depend on the number of jobs only. */

#include "common.h"

int split(int64_t extent, int threads, int64_t align, int64_t* per) {
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  *per = ((extent + threads - 1) / threads + align - 1) / align * align;
  if (*per < align) *per = align;
  return (int)((extent + *per - 1) / *per);
}

/* Job 0, and any whose thread failed to start, on the caller's thread; the others on
   threads started for this pass. */
static void own_threads(void* (*fn)(void*), char* at, size_t size, int used) {
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int t = 1; t < used; ++t) started[t] = pthread_create(&ids[t], 0, fn, at + t * size) == 0;
  for (int t = 0; t < used; ++t)
    if (!started[t]) fn(at + t * size);
  for (int t = 1; t < used; ++t)
    if (started[t]) pthread_join(ids[t], 0);
}

#ifdef _OPENMP

static volatile int forked = 0;
static void on_fork_child(void) { forked = 1; }
__attribute__((constructor)) static void threads_init(void) { pthread_atfork(0, 0, on_fork_child); }

/* Every job runs, whatever team OpenMP gives (a smaller one inside another parallel
   region, under OMP_THREAD_LIMIT, ...): a team of k threads runs jobs t, t + k, ... */
void run_jobs(void* (*fn)(void*), void* jobs, size_t size, int used) {
  char* at = (char*)jobs;
  if (used <= 1) {
    if (used == 1) fn(at);
    return;
  }
  if (forked) {
    own_threads(fn, at, size, used);
    return;
  }
#pragma omp parallel for num_threads(used) schedule(static, 1)
  for (int t = 0; t < used; ++t) fn(at + t * size);
}

const char* sdc_threading(void) { return forked ? "pthreads" : "openmp"; }

#else

void run_jobs(void* (*fn)(void*), void* jobs, size_t size, int used) {
  own_threads(fn, (char*)jobs, size, used);
}

const char* sdc_threading(void) { return "pthreads"; }

#endif
