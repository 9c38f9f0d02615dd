#include "textflag.h"

// func streamSum(dst, src *byte, stripes uintptr, acc *[8]uint64, secret *byte, inner uintptr) uintptr
//
// Y0, Y1: the accumulators; Y12, Y13: the scramble's part of the secret;
// Y14: prime32_1 in every lane. Per stripe: load, stream out, then
// acc[i^1] += v and acc[i] += lo32(v^k) * hi32(v^k), k read at secret +
// 8*inner.
TEXT ·streamSum(SB), NOSPLIT, $0-56
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ stripes+16(FP), CX
	MOVQ acc+24(FP), AX
	MOVQ secret+32(FP), DX
	MOVQ inner+40(FP), BX
	VMOVDQU 0(AX), Y0
	VMOVDQU 32(AX), Y1
	VMOVDQU 128(DX), Y12
	VMOVDQU 160(DX), Y13
	MOVQ $2654435761, R8
	MOVQ R8, X14
	VPBROADCASTQ X14, Y14
	TESTQ CX, CX
	JZ    done

loop:
	VMOVDQU  0(SI), Y2
	VMOVDQU  32(SI), Y3
	VMOVNTDQ Y2, 0(DI)
	VMOVNTDQ Y3, 32(DI)
	LEAQ     (DX)(BX*8), R9
	VPXOR    0(R9), Y2, Y4
	VPXOR    32(R9), Y3, Y5
	VPSRLQ   $32, Y4, Y6
	VPSRLQ   $32, Y5, Y7
	VPMULUDQ Y4, Y6, Y6
	VPMULUDQ Y5, Y7, Y7
	VPSHUFD  $0x4e, Y2, Y2
	VPSHUFD  $0x4e, Y3, Y3
	VPADDQ   Y2, Y0, Y0
	VPADDQ   Y3, Y1, Y1
	VPADDQ   Y6, Y0, Y0
	VPADDQ   Y7, Y1, Y1
	INCQ     BX
	CMPQ     BX, $16
	JNE      next

	// scramble: acc = (acc ^ acc>>47 ^ key) * prime32_1, the product of
	// a 64-bit lane and a 32-bit constant as lo*p + (hi*p)<<32
	VPSRLQ   $47, Y0, Y8
	VPSRLQ   $47, Y1, Y9
	VPXOR    Y8, Y0, Y0
	VPXOR    Y9, Y1, Y1
	VPXOR    Y12, Y0, Y0
	VPXOR    Y13, Y1, Y1
	VPSRLQ   $32, Y0, Y8
	VPSRLQ   $32, Y1, Y9
	VPMULUDQ Y14, Y0, Y0
	VPMULUDQ Y14, Y1, Y1
	VPMULUDQ Y14, Y8, Y8
	VPMULUDQ Y14, Y9, Y9
	VPSLLQ   $32, Y8, Y8
	VPSLLQ   $32, Y9, Y9
	VPADDQ   Y8, Y0, Y0
	VPADDQ   Y9, Y1, Y1
	XORQ     BX, BX

next:
	ADDQ $64, SI
	ADDQ $64, DI
	DECQ CX
	JNZ  loop
	SFENCE

done:
	VMOVDQU Y0, 0(AX)
	VMOVDQU Y1, 32(AX)
	VZEROUPPER
	MOVQ    BX, ret+48(FP)
	RET
