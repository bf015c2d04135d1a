"""pdserve_kernels.h read as ctypes: each exported function's argument and result types,
and the structs decoder.c takes, so a signature is written once, in C, for both sides.

Why generated rather than written again in Python and checked by a test: the C
compiler already holds every definition to the header, so reading the ctypes types from
the same text leaves no second copy to drift, and the wrappers read as calls. The parser
is strict and small: it knows the forms the header uses (a function declaration, a
`typedef struct` with one field per line, `__typeof__(function) *` fields) and the types
in `SCALARS` and `POINTEES`, and raises `HeaderError` on anything else, so a new kind of
type gets a mapping here before it reaches a kernel. tests/test_native_header.py checks
what this reads against the compiler's view of the same header.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).with_name("pdserve_kernels.h")
SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
# Pointers to these (or to a struct the header declares) go over as addresses: Python
# passes a tensor's data_ptr(), a struct's byref() or None.
POINTEES = {"void", "float", "int8_t", "uint8_t", "uint16_t", "int32_t", "int64_t"}

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_DIRECTIVE = re.compile(r"#[ \t]*(?:ifndef|define|endif|include)\b[^\n]*")
_STRUCT = re.compile(r"\s*typedef\s+struct\s*\{([^{}]*)\}\s*(\w+)\s*;")
_FUNCTION = re.compile(r"\s*(\w+)\s+(pdserve_\w+)\s*\(([^()]*)\)\s*;")
_VARIABLE = re.compile(r"(const\s+)?(\w+)(?:\s*(\*)\s*|\s+)(\w+)")      # [const] type [*] name
_FUNCTION_POINTER = re.compile(r"__typeof__\s*\(\s*(\w+)\s*\)\s*\*\s*(\w+)")


class HeaderError(ValueError):
    """pdserve_kernels.h holds something header.py does not read."""


@dataclass(frozen=True)
class Variable:
    """A parameter or field: its C type as written (`const int64_t *`), its name, and
    the ctypes type that carries it."""
    c_type: str
    name: str
    ctype: type

    @property
    def pointer(self) -> bool:
        return self.c_type.endswith("*")


@dataclass(frozen=True)
class Function:
    name: str
    result: Variable            # named "return"
    params: tuple[Variable, ...]

    @property
    def argtypes(self) -> list[type]:
        return [p.ctype for p in self.params]

    @property
    def restype(self) -> type:
        return self.result.ctype


@dataclass(frozen=True)
class Struct:
    name: str
    fields: tuple[Variable, ...]

    def ctype(self) -> type[ctypes.Structure]:
        """A ctypes Structure laid out as the C struct (ctypes follows the platform's
        C alignment, field by field)."""
        return type(self.name, (ctypes.Structure,), {"_fields_": [(f.name, f.ctype) for f in self.fields]})


@dataclass(frozen=True)
class Header:
    functions: dict[str, Function]
    structs: dict[str, Struct]


def read(path: Path = HEADER) -> Header:
    return parse(path.read_text())


def parse(text: str) -> Header:
    """Every function and struct the header declares, in order; HeaderError on anything
    else (a statement, preprocessor line or type this does not read)."""
    text = _COMMENT.sub(" ", text)
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not _DIRECTIVE.fullmatch(line.strip()):
            raise HeaderError(f"a preprocessor line header.py does not read: {line.strip()!r}")
    text = _DIRECTIVE.sub(" ", text)
    functions: dict[str, Function] = {}
    structs: dict[str, Struct] = {}
    pos = 0
    while text[pos:].strip():
        if m := _STRUCT.match(text, pos):
            body, name = m.groups()
            _add(structs, name, Struct(name, _fields(body, functions, structs)))
        elif m := _FUNCTION.match(text, pos):
            result, name, params = m.groups()
            _add(functions, name, Function(name, _variable(f"{result} return", structs, pointers=False),
                                           _params(params, structs)))
        else:
            raise HeaderError(f"cannot read the declaration at {text[pos:].strip()[:80]!r}")
        pos = m.end()
    return Header(functions, structs)


def _add(declared: dict, name: str, value: object) -> None:
    if name in declared:
        raise HeaderError(f"{name} is declared twice")
    declared[name] = value


def _params(text: str, structs: dict[str, Struct]) -> tuple[Variable, ...]:
    if text.strip() == "void":
        return ()
    params = tuple(_variable(p, structs) for p in text.split(","))
    if len({p.name for p in params}) != len(params):
        raise HeaderError(f"a parameter name repeats in ({text.strip()})")
    return params


def _fields(body: str, functions: dict[str, Function], structs: dict[str, Struct]) -> tuple[Variable, ...]:
    *fields, rest = body.split(";")
    if rest.strip():
        raise HeaderError(f"a struct field without its ';': {rest.strip()!r}")
    out = []
    for field in fields:
        if m := _FUNCTION_POINTER.fullmatch(field.strip()):
            function, name = m.groups()
            if function not in functions:
                raise HeaderError(f"__typeof__({function}): no such function declared before it")
            out.append(Variable(f"__typeof__({function}) *", name, ctypes.c_void_p))
        else:
            out.append(_variable(field, structs))
    if not out or len({f.name for f in out}) != len(out):
        raise HeaderError(f"a struct needs fields, each named once: {body.strip()[:80]!r}")
    return tuple(out)


def _variable(text: str, structs: dict[str, Struct], pointers: bool = True) -> Variable:
    m = _VARIABLE.fullmatch(text.strip())
    if m is None:
        raise HeaderError(f"cannot read {text.strip()!r}: one [const] type, at most one '*', then a name")
    const, base, star, name = m.groups()
    c_type = f"{'const ' if const else ''}{base}{' *' if star else ''}"
    if star and pointers and (base in POINTEES or base in structs):
        return Variable(c_type, name, ctypes.c_void_p)
    if not star and not const and base in SCALARS:
        return Variable(c_type, name, SCALARS[base])
    raise HeaderError(f"no ctypes mapping for {c_type!r} ({name})")
