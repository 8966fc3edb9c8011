/* SPDX-License-Identifier: Apache-2.0 */
/* See types.h in this directory: the architecture-neutral header is right for
 * BPF, whose longs are 64 bits wide on every host. */
#include <asm-generic/bitsperlong.h>
