package agent

import (
	"debug/elf"
	"encoding/binary"
	"fmt"

	"golang.org/x/arch/x86/x86asm"
)

// Return values of torch_npu's allocator functions are read at their
// return instructions, not with uretprobes: a uretprobe swaps the return
// address for a trampoline without unwind information, and a C++ exception
// thrown through the frame (allocate throws OutOfMemoryError) then kills the
// process in std::terminate. Plain uprobes on the `ret` instructions see the
// return value in its register and are never on an exception's path.

// returnSites lists where a function returns.
type returnSites struct {
	// offsets of return instructions, relative to the function's start
	offsets []uint64
	// tailCalls counts direct jumps out of the function: returns made by
	// the function jumped to are not seen at this function's return sites.
	tailCalls int
	// err says why the function could not be decoded, if it could not.
	err error
}

// findReturnSites decodes a function's machine code.
func findReturnSites(machine elf.Machine, code []byte) returnSites {
	switch machine {
	case elf.EM_X86_64:
		return x86ReturnSites(code)
	case elf.EM_AARCH64:
		return arm64ReturnSites(code)
	}
	return returnSites{err: fmt.Errorf("cannot decode %v code", machine)}
}

// x86ReturnSites decodes instructions from the start to the end of the
// function. GCC and clang put x86-64 jump tables in .rodata, so the body
// decodes linearly.
func x86ReturnSites(code []byte) returnSites {
	var rs returnSites
	for pc := 0; pc < len(code); {
		inst, err := x86asm.Decode(code[pc:], 64)
		if err != nil {
			rs.err = fmt.Errorf("undecodable instruction at +%#x: %w", pc, err)
			return rs
		}
		switch inst.Op {
		case x86asm.RET, x86asm.LRET:
			rs.offsets = append(rs.offsets, uint64(pc))
		case x86asm.JMP:
			if rel, ok := inst.Args[0].(x86asm.Rel); ok {
				target := pc + inst.Len + int(rel)
				if target < 0 || target >= len(code) {
					rs.tailCalls++
				}
			}
		}
		pc += inst.Len
	}
	if len(rs.offsets) == 0 && rs.err == nil {
		rs.err = fmt.Errorf("no return instruction in %d bytes", len(code))
	}
	return rs
}

// arm64ReturnSites scans the fixed-width instructions for RET and for
// branches out of the function.
func arm64ReturnSites(code []byte) returnSites {
	var rs returnSites
	for pc := 0; pc+4 <= len(code); pc += 4 {
		w := binary.LittleEndian.Uint32(code[pc:])
		switch {
		case w&0xfffffc1f == 0xd65f0000: // RET Xn
			rs.offsets = append(rs.offsets, uint64(pc))
		case w&0xfc000000 == 0x14000000: // B imm26
			imm := int64(int32(w<<6) >> 6) // sign-extend 26 bits
			target := int64(pc) + imm*4
			if target < 0 || target >= int64(len(code)) {
				rs.tailCalls++
			}
		}
	}
	if len(rs.offsets) == 0 {
		rs.err = fmt.Errorf("no return instruction in %d bytes", len(code))
	}
	return rs
}
