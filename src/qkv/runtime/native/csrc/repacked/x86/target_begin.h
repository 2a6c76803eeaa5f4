// Compile what follows (to target_end.h) for the instruction sets in QKV_TARGET, a string such
// as "avx2,fma,f16c", whatever the file's own flags: the x86 variants live beside the generic
// code in one library and the CPU picks one at run time (kernels.h's Variant). No include guard:
// each kernel file opens and closes its own target once.
#ifndef QKV_TARGET
#error "define QKV_TARGET before including target_begin.h"
#endif
#define QKV_PRAGMA_TEXT(x) _Pragma(#x)
#define QKV_PRAGMA(x) QKV_PRAGMA_TEXT(x)  // QKV_TARGET expanded before the pragma reads it
#if defined(__clang__)
QKV_PRAGMA(clang attribute push(__attribute__((target(QKV_TARGET))), apply_to = function))
#else
#pragma GCC push_options
QKV_PRAGMA(GCC target(QKV_TARGET))
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
