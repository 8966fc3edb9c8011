// Package bpf holds npuprobe's eBPF programs and the Go bindings bpf2go
// generates for them.
//
// The compiled objects for amd64 and arm64 are committed, so building
// npuprobe needs only Go. Regenerate them with `go generate ./bpf` on a
// machine with Debian's clang-19 and llvm-19 (the versions CI checks against:
// a different compiler produces different bytes, and CI fails on any diff).
// See README.md in this directory for why the programs look the way they do.
package bpf

// -mcpu=v3: 32-bit jumps and ALU ops make smaller, faster programs; every
// kernel with BPF ring buffers (5.8+) accepts them.
// -type npu_event: emit the record's Go type, so a test can check that the
// hand-written decoder in package agent agrees with the C layout.
//go:generate go tool bpf2go -cc clang-19 -strip llvm-strip-19 -target amd64,arm64 -type npu_event -cflags "-O2 -Wall -Werror -mcpu=v3" Npuprobe npuprobe.bpf.c -- -I./include
