/* SPDX-License-Identifier: Apache-2.0 */
/*
 * linux/types.h (pulled in by linux/bpf.h) includes <asm/types.h>, which lives
 * in an architecture directory such as /usr/include/x86_64-linux-gnu. BPF is
 * compiled for a virtual target, and every Linux architecture we build for
 * (amd64, arm64) uses the generic LL64 integer types, so this shim points at
 * the architecture-neutral header instead. It keeps `go generate` independent
 * of the host's multiarch layout and therefore byte-for-byte reproducible.
 */
#include <asm-generic/int-ll64.h>
