/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Register access for uprobe programs on the two architectures Ascend hosts
 * use, written out by hand.
 *
 * Why not bpf_tracing.h's PT_REGS_PARMn: without vmlinux.h it needs the
 * *target* architecture's <asm/ptrace.h>, which an amd64 host building the
 * arm64 object does not have, and with vmlinux.h the build would depend on
 * the BTF of the machine running `go generate`. The layouts below are kernel
 * ABI (the context of a uprobe program is the user task's saved registers,
 * struct pt_regs) and have not changed since BPF existed on either
 * architecture, so spelling them out keeps the build reproducible anywhere.
 *
 * bpf2go defines __TARGET_ARCH_x86 or __TARGET_ARCH_arm64 per object.
 */
#ifndef NPUPROBE_ARCH_REGS_H
#define NPUPROBE_ARCH_REGS_H

#include <linux/types.h>

#if defined(__TARGET_ARCH_x86)

/* arch/x86/include/asm/ptrace.h, x86-64 (the kernel's view, not the uapi one). */
struct npu_regs {
	__u64 r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	__u64 ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};

/* System V AMD64: rdi rsi rdx rcx r8 r9; result in rax. */
#define NPU_ARG0(r) ((r)->di)
#define NPU_ARG1(r) ((r)->si)
#define NPU_ARG2(r) ((r)->dx)
#define NPU_ARG3(r) ((r)->cx)
#define NPU_ARG4(r) ((r)->r8)
#define NPU_RET(r)  ((r)->ax)
/*
 * A C++ function returning a non-trivially-copyable object by value takes the
 * result address as a hidden first argument in rdi, shifting `this` to rsi
 * and the declared arguments one register along.
 */
#define NPU_SRET(r)           ((r)->di)
#define NPU_SRET_ARG(r, n)    NPU_ARG##n##_AFTER_SRET(r)
#define NPU_ARG0_AFTER_SRET(r) ((r)->si)
#define NPU_ARG1_AFTER_SRET(r) ((r)->dx)
#define NPU_ARG2_AFTER_SRET(r) ((r)->cx)

#elif defined(__TARGET_ARCH_arm64)

/* arch/arm64/include/uapi/asm/ptrace.h: struct user_pt_regs, which starts
 * the kernel's struct pt_regs. */
struct npu_regs {
	__u64 regs[31];
	__u64 sp;
	__u64 pc;
	__u64 pstate;
};

/* AAPCS64: x0-x7; result in x0. */
#define NPU_ARG0(r) ((r)->regs[0])
#define NPU_ARG1(r) ((r)->regs[1])
#define NPU_ARG2(r) ((r)->regs[2])
#define NPU_ARG3(r) ((r)->regs[3])
#define NPU_ARG4(r) ((r)->regs[4])
#define NPU_RET(r)  ((r)->regs[0])
/*
 * AAPCS64 passes the indirect-result address in x8, leaves `this` in x0 and
 * does not return x8: save it at entry.
 */
#define NPU_SRET(r)            ((r)->regs[8])
#define NPU_SRET_ARG(r, n)     NPU_ARG##n(r)

#else
#error "npuprobe's BPF programs are built for amd64 and arm64 only (bpf2go -target amd64,arm64)"
#endif

#endif /* NPUPROBE_ARCH_REGS_H */
