/* The public header, from the repository (bindings/swift/Sources/CStrata -> include/). */
#include "../../../../include/strata.h"
