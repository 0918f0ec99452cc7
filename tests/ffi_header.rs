//! include/strata.h is generated from src/ffi by cbindgen (cbindgen.toml)
//! and committed: this test fails when regenerating it would change it
//! (`STRATA_BLESS=1 cargo test --test ffi_header` rewrites it), and checks
//! that it compiles as C99 and C++17 with warnings as errors.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn generate() -> String {
    let config = cbindgen::Config::from_file(root().join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root().join("src/ffi/mod.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut out = Vec::new();
    bindings.write(&mut out);
    use_typedef_names(&String::from_utf8(out).expect("the header is UTF-8"))
}

/// cbindgen's `style = "both"` declares `typedef enum strata_status {...}
/// strata_status;` (so `enum strata_status` works too) but then writes
/// `enum strata_status` / `struct strata_engine` wherever a type is used.
/// The agreed header uses the typedef names there, as llama.h does; this
/// drops the tags everywhere but in the declarations themselves, and
/// re-aligns the wrapped argument lines that followed a shortened line.
fn use_typedef_names(header: &str) -> String {
    let strip = |s: &str| s.replace("enum strata_", "strata_").replace("struct strata_", "strata_");
    let mut out = String::with_capacity(header.len());
    let mut in_comment = false;
    // Open parentheses of a declaration wrapped over several lines, and the
    // columns its continuation lines move left.
    let (mut depth, mut shift) = (0i32, 0usize);
    for line in header.split_inclusive('\n') {
        let t = line.trim_start();
        if in_comment || t.starts_with("/*") || t.starts_with("//") {
            in_comment = if t.starts_with("/*") { !t.contains("*/") } else { in_comment && !t.contains("*/") };
            out.push_str(line);
            continue;
        }
        if t.starts_with("typedef enum ") || t.starts_with("typedef struct ") {
            out.push_str(line);
            continue;
        }
        if depth > 0 {
            let spaces = line.len() - t.len();
            out.push_str(&" ".repeat(spaces.saturating_sub(shift)));
            out.push_str(&strip(t));
        } else {
            let new = strip(line);
            let open = |s: &str| s.find('(').unwrap_or(0);
            shift = open(line) - open(&new);
            out.push_str(&new);
        }
        depth += line.matches('(').count() as i32 - line.matches(')').count() as i32;
    }
    out
}

#[test]
fn committed_header_is_current() {
    let fresh = generate();
    let path = root().join("include/strata.h");
    if std::env::var_os("STRATA_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/strata.h is out of date with src/ffi: run `STRATA_BLESS=1 cargo test --test ffi_header` and commit it"
    );
}

#[test]
fn header_has_the_agreed_names_and_no_test_hooks() {
    let h = generate();
    for want in [
        "typedef enum strata_status {",
        "STRATA_ERR_INTERNAL = 15",
        "typedef enum strata_log_level {",
        "typedef enum strata_kv_type {",
        "typedef struct strata_engine strata_engine;",
        "typedef struct strata_session strata_session;",
        "const char *strata_status_message(strata_status status);",
        "strata_status strata_set_log_callback(strata_log_fn callback, void *user_data, strata_log_level max_level);",
        "typedef bool (*strata_progress_fn)(void *user_data, float fraction);",
        "const char *const *devices;",
        "  strata_kv_type kv_type;",
        "strata_status strata_session_prefill(strata_session *s, const int32_t *tokens, size_t n_tokens);",
        "typedef void (*strata_log_fn)(void *user_data, strata_log_level level, const char *message);",
        "typedef struct strata_engine_params {",
        "strata_status strata_get_api(uint32_t abi_version, const strata_api **out);",
        "size_t n_tokens",
    ] {
        assert!(h.contains(want), "the header lacks {want:?}");
    }
    for unwanted in
        ["strata_test_", "StatusCode", "LogLevelCode", "uintptr_t", "(enum strata_", "(struct strata_", "MAX_STRUCT"]
    {
        assert!(!h.contains(unwanted), "the header has {unwanted:?}");
    }
}

/// Compiles a file that includes the header and checks the sizes the ABI
/// relies on. Skipped (with a note) when the compiler is not installed.
fn compile(compiler: &str, std: &str, ext: &str) {
    let dir = tempfile::tempdir().unwrap();
    // The generated header (equal to the committed one when
    // committed_header_is_current passes), so blessing cannot race this.
    std::fs::write(dir.path().join("strata.h"), generate()).unwrap();
    let src = dir.path().join(format!("use_header.{ext}"));
    std::fs::write(
        &src,
        r#"#include "strata.h"
#include <assert.h>
#ifdef __cplusplus
#define STATIC_ASSERT static_assert
#else
#define STATIC_ASSERT _Static_assert
#endif
STATIC_ASSERT(sizeof(strata_status) == 4, "strata_status is int-sized");
STATIC_ASSERT(sizeof(strata_log_level) == 4, "strata_log_level is int-sized");
STATIC_ASSERT(sizeof(strata_kv_type) == 4, "strata_kv_type is int-sized");
STATIC_ASSERT(STRATA_ERR_INTERNAL == 15, "fixed values");
int use_header(void);
int use_header(void) {
  strata_engine_params p;
  const strata_api *api = NULL;
  if (strata_engine_default_params(&p, (uint32_t)sizeof p) != STRATA_OK) return 1;
  if (strata_get_api(1, &api) != STRATA_OK || api->engine_load != strata_engine_load) return 2;
  return strata_status_message(STRATA_OK)[0] == 'o' ? 0 : 3;
}
"#,
    )
    .unwrap();
    let out: PathBuf = dir.path().join("use_header.o");
    let status = Command::new(compiler)
        .arg(format!("-std={std}"))
        .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-c"])
        .arg("-I")
        .arg(dir.path())
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .output();
    match status {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => eprintln!("{compiler} is not installed: skipped"),
        Err(e) => panic!("{compiler}: {e}"),
        Ok(o) => assert!(
            o.status.success(),
            "{compiler} -std={std} rejects include/strata.h:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
    }
}

#[test]
fn header_compiles_as_c99() {
    compile("cc", "c99", "c");
}

#[test]
fn header_compiles_as_cpp17() {
    compile("c++", "c++17", "cpp");
}

/// Every function the header declares is in include/strata.symbols and the
/// other way round (.ci/check-symbols.sh checks the list against the built
/// library).
#[test]
fn header_functions_match_the_symbol_list() {
    let h = generate();
    let mut declared: Vec<&str> = h
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with("typedef") && !l.starts_with('#'))
        .filter_map(|l| {
            let name = l.split('(').next()?.rsplit([' ', '*']).next()?;
            (name.starts_with("strata_") && l.contains('(')).then_some(name)
        })
        .collect();
    declared.sort();
    let symbols = std::fs::read_to_string(root().join("include/strata.symbols")).unwrap();
    let listed: Vec<&str> = symbols.lines().collect();
    assert_eq!(declared, listed, "include/strata.h and include/strata.symbols disagree");
}

/// The complete C example of docs/c-api.md (the code between
/// "```c\n#include <stdio.h>" and "```") compiles against the header.
/// `cargo test` does not build the cdylib, so .ci/check-c-example.sh links
/// and runs it against the release library.
#[test]
fn the_guide_example_compiles() {
    let guide = std::fs::read_to_string(root().join("docs/c-api.md")).unwrap();
    let start = guide.find("```c\n#include <stdio.h>").expect("the guide has its complete example") + 5;
    let code = &guide[start..start + guide[start..].find("```").unwrap()];
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("strata.h"), generate()).unwrap();
    std::fs::write(dir.path().join("example.c"), code).unwrap();
    let cc = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-c", "-I"])
        .arg(dir.path())
        .arg(dir.path().join("example.c"))
        .arg("-o")
        .arg(dir.path().join("example.o"))
        .output();
    match cc {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => eprintln!("cc is not installed: skipped"),
        Err(e) => panic!("cc: {e}"),
        Ok(o) => {
            assert!(o.status.success(), "the guide's example does not compile:\n{}", String::from_utf8_lossy(&o.stderr))
        }
    }
}
