/* SPDX-License-Identifier: Apache-2.0 */
/* See types.h in this directory. Only the generic types are used. */
#include <asm-generic/posix_types.h>
