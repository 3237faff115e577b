/* What the vendored sdt.h includes as "sdt-config.h" (systemtap's configure makes it; Debian's says 1): whether gas
 * takes `?` in .pushsection, which binutils has since 2.20. */
#define _SDT_ASM_SECTION_AUTOGROUP_SUPPORT 1
