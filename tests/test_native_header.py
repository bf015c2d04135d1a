"""pdserve_kernels.h, the one declaration of every native kernel's signature
(services/engine/kernels/native). The C compiler holds each definition to it; the ctypes
argument and result types, and the structs decoder.c takes, are read from it
(header.py). Checked here against the compiler's own view of the same header: the
declarations as read, redeclared next to the header, must not conflict, and each
parameter's, result's and field's size, kind and offset must be what ctypes passes. A
perturbed declaration on either side must be caught. Compiles small programs, decoder.c
and the sources' syntax only: a few seconds, no model."""
from __future__ import annotations

import ctypes
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from services.engine.kernels import native
from services.engine.kernels.native import header, library

NATIVE = Path(native.__file__).parent
SOURCES = sorted(NATIVE.glob("*.c"))
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler here")


def _kinds(ctype: type) -> tuple[int, bool, bool]:
    """Size, floating point, signed: what ctypes passes for one argument or field."""
    return ctypes.sizeof(ctype), ctype in (ctypes.c_float, ctypes.c_double), ctype(-1).value < 0


def _program(declared: header.Header) -> tuple[str, dict[str, tuple]]:
    """A C program that redeclares every function as `declared` reads it (a conflict with
    the header fails the compile) and prints each result's, parameter's and struct
    field's size and kind, each field's offset and each struct's size, as the compiler
    sees them; with what ctypes expects for each line."""
    lines, body, expected = ["#include <stddef.h>", "#include <stdio.h>", '#include "pdserve_kernels.h"'], [], {}

    def show(label: str, c_type: str, var: header.Variable, offset: str = "0", at: int = 0) -> None:
        kinds = "0, 0" if var.pointer else f"({c_type})0.5 != 0, ({c_type})-1 < 0"
        body.append(f'    printf("{label} %zu %d %d %zu\\n", sizeof({c_type}), {kinds}, (size_t){offset});')
        expected[label] = (*_kinds(var.ctype), at)

    for fn in declared.functions.values():
        lines.append(f"{fn.result.c_type} {fn.name}({', '.join(p.c_type for p in fn.params) or 'void'});")
        for var in (fn.result, *fn.params):
            show(f"{fn.name}.{var.name}", var.c_type, var)
    for struct in declared.structs.values():
        laid_out = struct.ctype()
        for field in struct.fields:
            show(f"{struct.name}.{field.name}", f"__typeof__((({struct.name} *)0)->{field.name})", field,
                 f"offsetof({struct.name}, {field.name})", getattr(laid_out, field.name).offset)
        body.append(f'    printf("{struct.name} %zu 0 0 0\\n", sizeof({struct.name}));')
        expected[struct.name] = (ctypes.sizeof(laid_out), False, False, 0)
    return "\n".join([*lines, "int main(void) {", *body, "    return 0;", "}", ""]), expected


def _disagreements(declared: header.Header, tmp_path: Path) -> list[str]:
    """Where `declared` (what the Python side passes) and the compiler's view of
    pdserve_kernels.h differ: the compiler's errors, or the lines whose size, kind or
    offset do."""
    text, expected = _program(declared)
    source, exe = tmp_path / "check.c", tmp_path / "check"
    source.write_text(text)
    built = subprocess.run([CC, "-I", str(NATIVE), str(source), "-o", str(exe)], capture_output=True, text=True)
    if built.returncode:
        return [line for line in built.stderr.splitlines() if "error" in line]
    seen = {}
    for line in subprocess.run([exe], capture_output=True, text=True, check=True).stdout.splitlines():
        label, size, floating, signed, offset = line.split()
        seen[label] = (int(size), floating == "1", signed == "1", int(offset))
    assert seen.keys() == expected.keys()
    return [f"{label}: C {seen[label]}, ctypes {kinds}" for label, kinds in expected.items() if seen[label] != kinds]


def _with_param(declared: header.Header, function: str, name: str, **change) -> header.Header:
    fn = declared.functions[function]
    params = tuple(dataclasses.replace(p, **change) if p.name == name else p for p in fn.params)
    return dataclasses.replace(declared, functions={**declared.functions,
                                                    function: dataclasses.replace(fn, params=params)})


def test_every_exported_function_is_declared_once_and_every_declared_one_exported():
    declared = header.read()
    defined = {name for source in SOURCES
               for name in re.findall(r"^(?!static\b)\w[\w \t*]*\b(pdserve_\w+)\s*\([^;]*?\)\s*\{",
                                      source.read_text(), re.M)}
    assert defined == set(declared.functions)
    for source in SOURCES:
        assert '#include "pdserve_kernels.h"' in source.read_text(), source.name
        # Every function the library exports has its prototype from the header.
        result = subprocess.run([CC, *library.COMPILE_FLAGS, "-fsyntax-only", "-Werror=missing-prototypes",
                                 str(source)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_every_name_the_python_side_uses_is_declared():
    used = {name for module in NATIVE.glob("*.py") for name in re.findall(r'"(pdserve_\w+)"', module.read_text())}
    declared = header.read()
    assert used and used <= set(declared.functions) | set(declared.structs), used - set(declared.functions)


def test_the_ctypes_declarations_are_the_compilers_view(tmp_path):
    declared = header.read()
    assert len(declared.functions) == 20 and set(declared.structs) == {"pdserve_kernels", "pdserve_layer",
                                                                       "pdserve_model"}
    assert _disagreements(declared, tmp_path) == []


def test_a_ctypes_type_that_disagrees_with_the_header_is_caught(tmp_path):
    declared = header.read()
    narrowed = _with_param(declared, "pdserve_rms_norm", "x_stride", ctype=ctypes.c_int)
    assert _disagreements(narrowed, tmp_path) == [
        "pdserve_rms_norm.x_stride: C (8, False, True, 0), ctypes (4, False, True, 0)"]
    assert _disagreements(_with_param(declared, "pdserve_rms_norm", "eps", ctype=ctypes.c_int), tmp_path)


def test_a_misread_c_declaration_is_caught(tmp_path):
    declared = header.read()
    misread = _with_param(declared, "pdserve_prefill_attention", "scale", c_type="double")
    assert any("conflicting types" in line and "pdserve_prefill_attention" in line
               for line in _disagreements(misread, tmp_path))
    fn = declared.functions["pdserve_rotary"]
    dropped = dataclasses.replace(declared, functions={**declared.functions,
                                                       fn.name: dataclasses.replace(fn, params=fn.params[:-1])})
    assert any("conflicting types" in line and "pdserve_rotary" in line
               for line in _disagreements(dropped, tmp_path))


def test_a_struct_field_that_disagrees_is_caught(tmp_path):
    declared = header.read()
    model = declared.structs["pdserve_model"]
    fields = tuple(dataclasses.replace(f, ctype=ctypes.c_double) if f.name == "scale" else f for f in model.fields)
    widened = dataclasses.replace(declared, structs={**declared.structs,
                                                    model.name: dataclasses.replace(model, fields=fields)})
    assert _disagreements(widened, tmp_path) == [
        "pdserve_model.scale: C (4, True, True, 88), ctypes (8, True, True, 88)"]


def test_a_definition_that_disagrees_with_the_header_does_not_build(tmp_path):
    for name in ("layers.c", "fastmath.h", "pdserve_kernels.h"):
        shutil.copy(NATIVE / name, tmp_path / name)
    decl = tmp_path / "pdserve_kernels.h"
    text, changed = re.subn(r"(int pdserve_rms_norm\([^;]*)float eps", r"\1double eps", decl.read_text())
    assert changed == 1
    decl.write_text(text)
    with pytest.raises(native.NativeBuildError, match="conflicting types for .pdserve_rms_norm"):
        library.build(tmp_path / "layers.c", tmp_path / "out")


def test_a_changed_header_rebuilds(tmp_path):
    for name in ("decoder.c", "pdserve_kernels.h"):
        shutil.copy(NATIVE / name, tmp_path / name)
    first = library.build(tmp_path / "decoder.c", tmp_path / "out")
    with (tmp_path / "pdserve_kernels.h").open("a") as f:
        f.write("/* changed */\n")
    second = library.build(tmp_path / "decoder.c", tmp_path / "out")
    assert second != first and first.exists() and second.exists()


def test_a_library_gives_only_declared_functions_typed_from_the_header(kernel_cache):
    loaded = library.load(native.load_decoder(kernel_cache))
    scratch = loaded.function("pdserve_decode_scratch")
    declared = header.read().functions["pdserve_decode_scratch"]
    assert (scratch.argtypes, scratch.restype) == (declared.argtypes, declared.restype)
    with pytest.raises(header.HeaderError, match="pdserve_decode_scrach is not declared"):
        loaded.function("pdserve_decode_scrach")
    with pytest.raises(header.HeaderError, match="struct pdserve_modle"):
        loaded.struct("pdserve_modle")


@pytest.mark.parametrize("text, complaint", [
    ("int pdserve_f(double x);", "no ctypes mapping for 'double'"),
    ("long pdserve_f(void);", "no ctypes mapping for 'long'"),
    ("int pdserve_f(const int64_t **x);", "cannot read"),
    ("int pdserve_f(int);", "cannot read"),
    ("int pdserve_f(const int x);", "no ctypes mapping for 'const int'"),
    ("int pdserve_f(int x, int x);", "repeats"),
    ("int helper(int x);", "cannot read the declaration"),
    ("static int pdserve_f(int x);", "cannot read the declaration"),
    ("int pdserve_f(int x); int pdserve_f(int x);", "declared twice"),
    ("#if defined(X)\nint pdserve_f(int x);\n#endif", "preprocessor line"),
    ("typedef struct { int a, b; } s;", "cannot read 'int a, b'"),
    ("typedef struct { int a; int b } s;", "without its ';'"),
    ("typedef struct { __typeof__(pdserve_g) *f; } s;", "no such function"),
    ("typedef struct { float *f; } s; int pdserve_f(s x);", "no ctypes mapping for 's'"),
])
def test_the_parser_refuses_what_it_does_not_read(text, complaint):
    with pytest.raises(header.HeaderError, match=re.escape(complaint)):
        header.parse(text)


def test_the_parser_reads_the_forms_the_header_uses():
    read = header.parse("""/* a comment */
        #include <stdint.h>
        int64_t pdserve_f(const float *x, int64_t n, float s, int k);  // a line comment
        typedef struct { __typeof__(pdserve_f) *f; const uint16_t *w; float eps; } pdserve_s;
        int pdserve_g(const pdserve_s *s);""")
    f = read.functions["pdserve_f"]
    assert (f.restype, f.argtypes) == (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int])
    assert [p.c_type for p in f.params] == ["const float *", "int64_t", "float", "int"]
    assert read.functions["pdserve_g"].argtypes == [ctypes.c_void_p]
    assert read.structs["pdserve_s"].ctype()._fields_ == [("f", ctypes.c_void_p), ("w", ctypes.c_void_p),
                                                          ("eps", ctypes.c_float)]
