/* The threads every pass of the kernel splits its work over (common.h). */

#include "common.h"

int split(int64_t extent, int threads, int64_t align, int64_t* per) {
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  *per = ((extent + threads - 1) / threads + align - 1) / align * align;
  if (*per < align) *per = align;
  return (int)((extent + *per - 1) / *per);
}

void run_jobs(void* (*fn)(void*), void* jobs, size_t size, int used) {
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  char* at = (char*)jobs;
  for (int t = 1; t < used; ++t) started[t] = pthread_create(&ids[t], 0, fn, at + t * size) == 0;
  for (int t = 0; t < used; ++t)
    if (!started[t]) fn(at + t * size);
  for (int t = 1; t < used; ++t)
    if (started[t]) pthread_join(ids[t], 0);
}
