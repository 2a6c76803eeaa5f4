// Ends target_begin.h's instruction-set target.
#pragma GCC diagnostic pop
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#undef QKV_TARGET
