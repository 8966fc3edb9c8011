#include "textflag.h"

// func readCounter() uint64
TEXT ·readCounter(SB),NOSPLIT,$0-8
	ISB	$15
	MRS	CNTVCT_EL0, R0
	MOVD	R0, ret+0(FP)
	RET
