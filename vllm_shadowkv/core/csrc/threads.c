/* The threads the kernels' parallel loops take: torch's (native.OPENMP), 1 in a build without
 * OpenMP. */
#ifdef _OPENMP
#include <omp.h>
#endif

int kernel_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
