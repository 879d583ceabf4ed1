//! Explicit discovery and loading of the CUDA shared libraries.
//!
//! cudarc (with `dynamic-loading`) opens each library by bare name on first
//! use and panics when none of its candidate names resolves. Its candidates
//! start with unversioned names (`libnvrtc.so`) that pip wheels do not ship,
//! and cudarc 0.19.10 offers no way to hand it a path. So before any cudarc
//! call we:
//!
//! 1. find the exact file ourselves, in this order: the override variable
//!    (`UPIPE_<LIB>_LIB=/path/file.so`), `$CUDA_HOME/{targets/x86_64-linux/lib,lib64}`,
//!    `/usr/local/cuda*/{targets/x86_64-linux/lib,lib64}`, the loader cache
//!    (`ldconfig -p`) and the standard library folders, then Python
//!    `site-packages/nvidia/*/lib` folders;
//! 2. `dlopen` it by full path with `RTLD_GLOBAL` and keep it open forever, so
//!    that a later `dlopen` by its soname (one of cudarc's candidates) returns
//!    this same object;
//! 3. ask cudarc whether any of its candidate names now resolves
//!    (`is_culib_present`, which never panics), and only then let it bind;
//! 4. ask `dladdr` which file cudarc's handle really points at, and record
//!    that file and its version.
//!
//! A library that cannot be found or bound gives [`Error::LibraryMissing`]
//! naming everything that was searched; nothing here panics.

use crate::error::{Error, Result};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One CUDA library upipe can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lib {
    /// The driver API (`libcuda.so.1`), installed with the kernel driver.
    Cuda,
    /// Run-time compiler for our kernels.
    Nvrtc,
    /// cuBLASLt (GEMM).
    CublasLt,
    /// cuBLAS (loaded only because cuBLASLt-based tools sometimes need it).
    Cublas,
    /// cuDNN (SDPA attention).
    Cudnn,
    /// NCCL (collectives).
    Nccl,
}

impl Lib {
    /// All libraries, in the order `upipe info` prints them.
    pub const ALL: [Lib; 6] = [
        Lib::Cuda,
        Lib::Nvrtc,
        Lib::CublasLt,
        Lib::Cublas,
        Lib::Cudnn,
        Lib::Nccl,
    ];

    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Lib::Cuda => "libcuda",
            Lib::Nvrtc => "nvrtc",
            Lib::CublasLt => "cublasLt",
            Lib::Cublas => "cublas",
            Lib::Cudnn => "cudnn",
            Lib::Nccl => "nccl",
        }
    }

    /// The unversioned file name, e.g. `libnvrtc.so`.
    pub fn stem(self) -> &'static str {
        match self {
            Lib::Cuda => "libcuda.so",
            Lib::Nvrtc => "libnvrtc.so",
            Lib::CublasLt => "libcublasLt.so",
            Lib::Cublas => "libcublas.so",
            Lib::Cudnn => "libcudnn.so",
            Lib::Nccl => "libnccl.so",
        }
    }

    /// The variable that names the exact file to load.
    pub fn env_var(self) -> &'static str {
        match self {
            Lib::Cuda => "UPIPE_CUDA_LIB",
            Lib::Nvrtc => "UPIPE_NVRTC_LIB",
            Lib::CublasLt => "UPIPE_CUBLASLT_LIB",
            Lib::Cublas => "UPIPE_CUBLAS_LIB",
            Lib::Cudnn => "UPIPE_CUDNN_LIB",
            Lib::Nccl => "UPIPE_NCCL_LIB",
        }
    }

    /// Sub-folders of `site-packages/nvidia` that pip wheels put this library in.
    fn pip_dirs(self) -> &'static [&'static str] {
        match self {
            Lib::Cuda => &[],
            Lib::Nvrtc => &["cu13", "cuda_nvrtc"],
            Lib::CublasLt | Lib::Cublas => &["cu13", "cublas"],
            Lib::Cudnn => &["cudnn"],
            Lib::Nccl => &["nccl", "cu13"],
        }
    }

    /// A symbol every version exports (used to ask `dladdr` where it lives).
    fn probe_symbol(self) -> &'static [u8] {
        match self {
            Lib::Cuda => b"cuDriverGetVersion\0",
            Lib::Nvrtc => b"nvrtcVersion\0",
            Lib::CublasLt => b"cublasLtGetVersion\0",
            Lib::Cublas => b"cublasGetProperty\0",
            Lib::Cudnn => b"cudnnGetVersion\0",
            Lib::Nccl => b"ncclGetVersion\0",
        }
    }
}

/// A library that was found and loaded.
#[derive(Debug, Clone)]
pub struct LoadedLib {
    pub lib: Lib,
    /// The file we opened (as found, before resolving links).
    pub path: PathBuf,
    /// The file cudarc's handle points at (via `dladdr`); normally `path`'s target.
    pub bound_path: Option<PathBuf>,
    /// Version from the resolved file name, e.g. `13.1.0.3` for `libcublasLt.so.13.1.0.3`.
    pub file_version: Option<String>,
    /// Version the library reports through its API, e.g. `13.0` or `2.28.3`.
    pub api_version: Option<String>,
    /// Whether cudarc's own loader resolves to this library (required to use it through cudarc).
    pub cudarc_bound: bool,
    /// Where it was found (`override`, `CUDA_HOME`, `loader cache`, `pip`, ...).
    pub source: &'static str,
}

impl LoadedLib {
    /// `path (version)` for tables.
    pub fn describe(&self) -> String {
        let shown = self.bound_path.as_ref().unwrap_or(&self.path);
        let mut s = shown.display().to_string();
        if let Some(v) = &self.api_version {
            s.push_str(&format!("  api {v}"));
        }
        if let Some(v) = &self.file_version {
            s.push_str(&format!("  file {v}"));
        }
        s.push_str(&format!("  [{}]", self.source));
        if !self.cudarc_bound {
            s.push_str("  (found, but cudarc cannot bind it by name)");
        }
        s
    }
}

/// A place searched, for the error message.
#[derive(Debug, Clone)]
struct Candidate {
    path: PathBuf,
    source: &'static str,
}

/// Folders to search for `lib`, in priority order, with where each came from.
/// Pure function of the environment and the file system; no loading.
fn search_dirs(lib: Lib) -> Vec<(PathBuf, &'static str)> {
    let mut dirs: Vec<(PathBuf, &'static str)> = Vec::new();
    let toolkit = lib != Lib::Cuda; // the driver never lives in the toolkit (only its link stub does)
    if toolkit {
        if let Some(home) = std::env::var_os("CUDA_HOME").or_else(|| std::env::var_os("CUDA_PATH"))
        {
            let home = PathBuf::from(home);
            dirs.push((home.join("targets/x86_64-linux/lib"), "CUDA_HOME"));
            dirs.push((home.join("lib64"), "CUDA_HOME"));
            dirs.push((home.join("lib"), "CUDA_HOME"));
        }
        let mut roots: Vec<PathBuf> = glob_dir(Path::new("/usr/local"), |n| n.starts_with("cuda"));
        // `cuda` (the symlink) first, then newest versioned trees.
        roots.sort_by_key(|r| std::cmp::Reverse(version_key(r)));
        roots.sort_by_key(|p| p.file_name().map(|n| n != "cuda").unwrap_or(true));
        for r in roots {
            dirs.push((r.join("targets/x86_64-linux/lib"), "/usr/local/cuda*"));
            dirs.push((r.join("lib64"), "/usr/local/cuda*"));
        }
    }
    for d in ldconfig_dirs(lib) {
        dirs.push((d, "loader cache"));
    }
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib64",
        "/usr/lib",
        "/lib/x86_64-linux-gnu",
    ] {
        dirs.push((PathBuf::from(d), "standard dirs"));
    }
    if toolkit {
        for sp in site_packages() {
            for sub in lib.pip_dirs() {
                dirs.push((sp.join("nvidia").join(sub).join("lib"), "pip"));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|(d, _)| seen.insert(d.clone()));
    dirs
}

/// Python package folders that may hold NVIDIA wheels.
fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    roots.push(PathBuf::from("/opt/torch/.venv/lib"));
    roots.push(PathBuf::from("/usr/local/lib"));
    roots.push(PathBuf::from("/usr/lib"));
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    let mut out = Vec::new();
    for r in roots {
        let mut pys = glob_dir(&r, |n| n.starts_with("python3"));
        pys.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
        for p in pys {
            for sub in ["site-packages", "dist-packages"] {
                let d = p.join(sub);
                if d.is_dir() {
                    out.push(d);
                }
            }
        }
    }
    out
}

fn glob_dir(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .map(|e| e.path())
        .collect()
}

/// Numeric components of a file name, for "newest first" ordering.
fn version_key(p: &Path) -> Vec<u64> {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// Folders the loader cache lists for this library.
fn ldconfig_dirs(lib: Lib) -> Vec<PathBuf> {
    let out = ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"]
        .iter()
        .find_map(|exe| std::process::Command::new(exe).arg("-p").output().ok());
    let Some(out) = out else {
        return Vec::new();
    };
    parse_ldconfig(&String::from_utf8_lossy(&out.stdout), lib.stem())
}

/// Parses `ldconfig -p` lines like `\tlibnccl.so.2 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so.2`.
fn parse_ldconfig(text: &str, stem: &str) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if !is_lib_file(name, stem) || !line.contains("x86-64") {
            continue;
        }
        if let Some((_, path)) = line.split_once("=> ")
            && let Some(parent) = Path::new(path.trim()).parent()
            && !dirs.iter().any(|d: &PathBuf| d == parent)
        {
            dirs.push(parent.to_path_buf());
        }
    }
    dirs
}

/// `libx.so` or `libx.so.<digits and dots>`.
fn is_lib_file(name: &str, stem: &str) -> bool {
    match name.strip_prefix(stem) {
        Some("") => true,
        Some(rest) => {
            rest.starts_with('.')
                && rest[1..]
                    .split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        }
        None => false,
    }
}

/// The best file for `stem` in `dir`: the soname-like `stem.N` first, then the
/// plain name, then longer versions.
fn pick_in_dir(dir: &Path, stem: &str) -> Option<PathBuf> {
    let mut files: Vec<PathBuf> = glob_dir(dir, |n| is_lib_file(n, stem))
        .into_iter()
        .filter(|p| p.exists())
        .collect();
    files.sort_by_key(|p| {
        let n = p
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_string();
        let dots = n[stem.len()..].matches('.').count();
        let rank = match dots {
            1 => 0,
            0 => 1,
            _ => 2,
        };
        (rank, n)
    });
    files.into_iter().next()
}

/// Every file that would be tried, in order (the first one that opens wins).
fn candidates(
    lib: Lib,
    override_path: Option<std::ffi::OsString>,
) -> (Vec<Candidate>, Vec<String>) {
    let mut searched = Vec::new();
    let mut found = Vec::new();
    if let Some(p) = override_path {
        let p = PathBuf::from(p);
        searched.push(format!("{}={}", lib.env_var(), p.display()));
        // An explicit override is the only choice: falling back would hide a typo.
        found.push(Candidate {
            path: p,
            source: "override",
        });
        return (found, searched);
    }
    for (dir, source) in search_dirs(lib) {
        searched.push(dir.display().to_string());
        if let Some(p) = pick_in_dir(&dir, lib.stem()) {
            found.push(Candidate { path: p, source });
        }
    }
    (found, searched)
}

/// Resolved file name's version suffix: `libnccl.so.2.28.3` -> `2.28.3`.
fn file_version(path: &Path, stem: &str) -> Option<String> {
    let real = std::fs::canonicalize(path).ok()?;
    let name = real.file_name()?.to_str()?;
    name.strip_prefix(stem)?
        .strip_prefix('.')
        .map(str::to_string)
}

#[repr(C)]
struct DlInfo {
    dli_fname: *const c_char,
    dli_fbase: *mut c_void,
    dli_sname: *const c_char,
    dli_saddr: *mut c_void,
}

unsafe extern "C" {
    fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
}

/// The file that holds `addr`.
fn file_of(addr: *const c_void) -> Option<PathBuf> {
    let mut info = DlInfo {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads `addr` as an address and fills `info`.
    let ok = unsafe { dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    let s = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(s.to_string_lossy().into_owned()))
}

/// cudarc's own handle of `lib`, if its loader can resolve one (never panics).
fn cudarc_handle(lib: Lib) -> Option<&'static libloading::Library> {
    // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's candidate names;
    // `culib` is called only when that succeeded, so it cannot reach its panic.
    unsafe {
        match lib {
            Lib::Cuda => {
                cudarc::driver::sys::is_culib_present().then(|| cudarc::driver::sys::culib())
            }
            Lib::Nvrtc => {
                cudarc::nvrtc::sys::is_culib_present().then(|| cudarc::nvrtc::sys::culib())
            }
            Lib::CublasLt => {
                cudarc::cublaslt::sys::is_culib_present().then(|| cudarc::cublaslt::sys::culib())
            }
            Lib::Cublas => {
                cudarc::cublas::sys::is_culib_present().then(|| cudarc::cublas::sys::culib())
            }
            Lib::Cudnn => {
                cudarc::cudnn::sys::is_culib_present().then(|| cudarc::cudnn::sys::culib())
            }
            Lib::Nccl => cudarc::nccl::sys::is_culib_present().then(|| cudarc::nccl::sys::culib()),
        }
    }
}

/// The version the library reports, read through our own handle.
fn api_version(lib: Lib, h: &libloading::Library) -> Option<String> {
    // SAFETY: each symbol is looked up by its documented name and called with
    // its documented C signature.
    unsafe {
        match lib {
            Lib::Cuda => {
                let f = h
                    .get::<unsafe extern "C" fn(*mut c_int) -> c_int>(b"cuDriverGetVersion\0")
                    .ok()?;
                let mut v = 0;
                (f(&mut v) == 0).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
            }
            Lib::Nvrtc => {
                let f = h
                    .get::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>(b"nvrtcVersion\0")
                    .ok()?;
                let (mut a, mut b) = (0, 0);
                (f(&mut a, &mut b) == 0).then(|| format!("{a}.{b}"))
            }
            Lib::CublasLt => {
                let f = h
                    .get::<unsafe extern "C" fn() -> usize>(b"cublasLtGetVersion\0")
                    .ok()?;
                let v = f();
                Some(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
            }
            Lib::Cublas => {
                let f = h
                    .get::<unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int>(
                        b"cublasGetVersion_v2\0",
                    )
                    .ok()?;
                let mut v = 0;
                (f(std::ptr::null_mut(), &mut v) == 0)
                    .then(|| format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
            }
            Lib::Cudnn => {
                let f = h
                    .get::<unsafe extern "C" fn() -> usize>(b"cudnnGetVersion\0")
                    .ok()?;
                let v = f();
                Some(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
            }
            Lib::Nccl => {
                let f = h
                    .get::<unsafe extern "C" fn(*mut c_int) -> c_int>(b"ncclGetVersion\0")
                    .ok()?;
                let mut v = 0;
                (f(&mut v) == 0).then(|| format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
            }
        }
    }
}

/// Opens a file by full path, globally, so later loads by soname reuse it.
fn open_global(path: &Path) -> std::result::Result<libloading::Library, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a CUDA library runs its initialisers, which have no
    // preconditions beyond a working process.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(libloading::Library::from)
        .map_err(|e| e.to_string())
}

fn load_uncached(lib: Lib) -> std::result::Result<LoadedLib, String> {
    load_from(lib, candidates(lib, std::env::var_os(lib.env_var())))
}

fn load_from(
    lib: Lib,
    (cands, searched): (Vec<Candidate>, Vec<String>),
) -> std::result::Result<LoadedLib, String> {
    let mut errors = Vec::new();
    for c in cands {
        match open_global(&c.path) {
            Ok(handle) => {
                if lib == Lib::Nvrtc {
                    preload_nvrtc_builtins(&c.path);
                }
                let api = api_version(lib, &handle);
                let bound = cudarc_handle(lib);
                let bound_path = bound.and_then(|h| {
                    // SAFETY: the symbol is only used as an address for dladdr.
                    let sym = unsafe { h.get::<*const c_void>(lib.probe_symbol()) }.ok()?;
                    file_of(*sym)
                });
                let loaded = LoadedLib {
                    lib,
                    path: c.path.clone(),
                    file_version: file_version(
                        bound_path.as_deref().unwrap_or(&c.path),
                        lib.stem(),
                    ),
                    bound_path,
                    api_version: api,
                    cudarc_bound: bound.is_some(),
                    source: c.source,
                };
                if let (Some(b), Ok(ours)) = (&loaded.bound_path, std::fs::canonicalize(&c.path))
                    && std::fs::canonicalize(b).ok().as_ref() != Some(&ours)
                {
                    tracing::warn!(
                        "{}: opened {} but cudarc bound {}; using cudarc's",
                        lib.name(),
                        c.path.display(),
                        b.display()
                    );
                }
                // Keep our handle open for the life of the process.
                std::mem::forget(handle);
                return Ok(loaded);
            }
            Err(e) => errors.push(format!("{}: {e}", c.path.display())),
        }
    }
    let mut msg = format!(
        "{} ({}*) not found; searched: {}",
        lib.name(),
        lib.stem(),
        searched.join(", ")
    );
    if !errors.is_empty() {
        msg.push_str(&format!("; failed to open: {}", errors.join("; ")));
    }
    msg.push_str(&format!(
        "; set {}=/path/to/{}.N to choose a file",
        lib.env_var(),
        lib.stem()
    ));
    Err(msg)
}

/// NVRTC opens `libnvrtc-builtins.so.X.Y` by name at compile time; open the one
/// beside the chosen NVRTC first so that name resolves without LD_LIBRARY_PATH.
fn preload_nvrtc_builtins(nvrtc: &Path) {
    let real = std::fs::canonicalize(nvrtc).unwrap_or_else(|_| nvrtc.to_path_buf());
    for dir in [nvrtc.parent(), real.parent()].into_iter().flatten() {
        let mut files = glob_dir(dir, |n| n.starts_with("libnvrtc-builtins.so"));
        files.sort_by_key(|p| std::cmp::Reverse(p.file_name().map(|n| n.len()).unwrap_or(0)));
        for f in files {
            if let Ok(h) = open_global(&f) {
                std::mem::forget(h);
                return;
            }
        }
    }
}

/// Finds and loads `lib` once per process; later calls return the same answer.
pub fn load(lib: Lib) -> Result<&'static LoadedLib> {
    static SLOTS: [OnceLock<std::result::Result<LoadedLib, String>>; 6] =
        [const { OnceLock::new() }; 6];
    let i = Lib::ALL
        .iter()
        .position(|l| *l == lib)
        .expect("every Lib is in ALL");
    let r = SLOTS[i].get_or_init(|| load_uncached(lib));
    match r {
        Ok(l) if l.cudarc_bound => Ok(l),
        Ok(l) => Err(Error::LibraryMissing(format!(
            "{} was found at {} but cudarc's loader resolves none of its names ({:?}...); \
             add its folder to LD_LIBRARY_PATH or provide a {} link",
            lib.name(),
            l.path.display(),
            cudarc::get_lib_name_candidates(&lib.stem()[3..lib.stem().len() - 3])
                .into_iter()
                .take(3)
                .collect::<Vec<_>>(),
            lib.stem()
        ))),
        Err(m) => Err(Error::LibraryMissing(m.clone())),
    }
}

/// Found-or-why for every library (for `upipe info`); loads each one.
pub fn report() -> Vec<(Lib, std::result::Result<LoadedLib, String>)> {
    Lib::ALL
        .iter()
        .map(|&l| {
            let r = match load(l) {
                Ok(x) => Ok(x.clone()),
                Err(e) => Err(e.to_string()),
            };
            (l, r)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lib_file_names() {
        assert!(is_lib_file("libnccl.so", "libnccl.so"));
        assert!(is_lib_file("libnccl.so.2", "libnccl.so"));
        assert!(is_lib_file("libnccl.so.2.28.3", "libnccl.so"));
        assert!(!is_lib_file("libnccl.so.2.txt", "libnccl.so"));
        assert!(!is_lib_file("libnccl.so.", "libnccl.so"));
        assert!(!is_lib_file("libnccl_static.a", "libnccl.so"));
        assert!(!is_lib_file("libnvrtc-builtins.so.13", "libnvrtc.so"));
    }

    #[test]
    fn picks_soname_over_plain_and_long_versions() {
        let dir = std::env::temp_dir().join(format!("upipe-libs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in [
            "libcublasLt.so.13.1.0.3",
            "libcublasLt.so",
            "libcublasLt.so.13",
            "libcublas.so.13",
        ] {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        let p = pick_in_dir(&dir, "libcublasLt.so").unwrap();
        assert_eq!(p.file_name().unwrap(), "libcublasLt.so.13");
        assert_eq!(pick_in_dir(&dir, "libnccl.so"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn parses_loader_cache() {
        let text = "3 libs found in cache `/etc/ld.so.cache'\n\
            \tlibnccl.so.2 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so.2\n\
            \tlibnccl.so.2 (libc6) => /usr/lib32/libnccl.so.2\n\
            \tlibnvrtc.so.13 (libc6,x86-64) => /usr/local/cuda/lib64/libnvrtc.so.13\n";
        assert_eq!(
            parse_ldconfig(text, "libnccl.so"),
            vec![PathBuf::from("/usr/lib/x86_64-linux-gnu")]
        );
        assert_eq!(parse_ldconfig(text, "libcudnn.so"), Vec::<PathBuf>::new());
    }

    #[test]
    fn driver_is_never_taken_from_the_toolkit() {
        let dirs = search_dirs(Lib::Cuda);
        assert!(
            dirs.iter()
                .all(|(d, _)| !d.to_string_lossy().contains("/usr/local/cuda"))
        );
        let nv = search_dirs(Lib::Nvrtc);
        assert!(
            nv.iter()
                .any(|(d, s)| *s == "pip" && d.ends_with("nvidia/cu13/lib"))
                || site_packages().is_empty()
        );
    }

    #[test]
    fn a_wrong_override_is_an_error_naming_it() {
        let bad = std::ffi::OsString::from("/nonexistent/libnccl.so.2");
        let (cands, searched) = candidates(Lib::Nccl, Some(bad));
        assert_eq!(cands.len(), 1, "an override is the only candidate");
        let err = load_from(Lib::Nccl, (cands, searched)).unwrap_err();
        assert!(
            err.contains("UPIPE_NCCL_LIB=/nonexistent/libnccl.so.2"),
            "{err}"
        );
        assert!(err.contains("failed to open"), "{err}");
    }

    #[test]
    fn version_from_resolved_name() {
        let dir = std::env::temp_dir().join(format!("upipe-libv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnccl.so.2.28.9"), b"x").unwrap();
        std::os::unix::fs::symlink(dir.join("libnccl.so.2.28.9"), dir.join("libnccl.so.2"))
            .unwrap();
        assert_eq!(
            file_version(&dir.join("libnccl.so.2"), "libnccl.so").as_deref(),
            Some("2.28.9")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
