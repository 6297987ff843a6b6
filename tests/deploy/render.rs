//! Finding every kustomization under deploy/ and rendering each with `kubectl kustomize`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::ROOT;

/// The file names kustomize accepts for a kustomization.
const KUSTOMIZATION_FILES: [&str; 3] = ["kustomization.yaml", "kustomization.yml", "Kustomization"];

/// A directory under deploy/ holding a kustomization.
pub(crate) struct Kustomization {
    pub(crate) dir: PathBuf,
    /// `Kustomization` or `Component`.
    pub(crate) kind: String,
    /// The directories it lists under `components:`.
    pub(crate) components: Vec<PathBuf>,
}

impl Kustomization {
    pub(crate) fn name(&self) -> String {
        let root = canonical(Path::new(ROOT));
        let relative = self.dir.strip_prefix(&root).unwrap_or(&self.dir);
        relative.display().to_string()
    }
}

/// Every kustomization under deploy/, found by walking it: a new one is covered without a change here.
pub(crate) fn kustomizations() -> &'static [Kustomization] {
    static FOUND: OnceLock<Vec<Kustomization>> = OnceLock::new();
    FOUND.get_or_init(|| {
        let mut dirs = Vec::new();
        walk(&Path::new(ROOT).join("deploy"), &mut dirs);
        dirs.sort();
        assert!(
            !dirs.is_empty(),
            "no kustomization.yaml under {ROOT}/deploy"
        );
        dirs.iter().map(|dir| read_kustomization(dir)).collect()
    })
}

fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|err| panic!("cannot list {}: {err}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
            .path();
        if path.is_dir() {
            walk(&path, found);
        } else if path
            .file_name()
            .is_some_and(|name| KUSTOMIZATION_FILES.iter().any(|file| name == *file))
        {
            found.push(dir.to_owned());
        }
    }
}

fn read_kustomization(dir: &Path) -> Kustomization {
    let path = KUSTOMIZATION_FILES
        .iter()
        .map(|file| dir.join(file))
        .find(|path| path.is_file())
        .unwrap_or_else(|| dir.join(KUSTOMIZATION_FILES[0]));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()));
    let value: Value = serde_saphyr::from_str(&text)
        .unwrap_or_else(|err| panic!("{} is not YAML: {err}", path.display()));
    let components = value["components"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    Kustomization {
        dir: canonical(dir),
        kind: value["kind"].as_str().unwrap_or("Kustomization").to_owned(),
        components: components
            .iter()
            .filter_map(Value::as_str)
            .map(|relative| canonical(&dir.join(relative)))
            .collect(),
    }
}

fn canonical(path: &Path) -> PathBuf {
    path.canonicalize()
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// `kubectl kustomize DIR`, split into its objects.
fn render(dir: &Path) -> Vec<Value> {
    let output = match Command::new("kubectl").arg("kustomize").arg(dir).output() {
        Ok(output) => output,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            panic!("kubectl is missing: install Debian's kubernetes-client (scripts/test.sh does)")
        }
        Err(err) => panic!("cannot run kubectl: {err}"),
    };
    assert!(
        output.status.success(),
        "`kubectl kustomize {}` failed ({}):\n{}",
        dir.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let documents: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap_or_else(|err| {
        panic!(
            "`kubectl kustomize {}` printed no valid YAML: {err}",
            dir.display()
        )
    });
    documents.into_iter().filter(|doc| !doc.is_null()).collect()
}

/// Every kustomization built on its own (a Component is built as part of the overlays using it), with
/// its objects.
pub(crate) fn rendered() -> &'static [(String, Vec<Value>)] {
    static RENDERED: OnceLock<Vec<(String, Vec<Value>)>> = OnceLock::new();
    RENDERED.get_or_init(|| {
        let built = kustomizations().iter().filter(|k| k.kind != "Component");
        built.map(|k| (k.name(), render(&k.dir))).collect()
    })
}
