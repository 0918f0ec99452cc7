// swift-tools-version:5.7
// The Strata C API for Swift: a system-library target (module map over
// include/strata.h), a thin Swift wrapper and an example executable.
//
//   cargo build --release          (in the repository root)
//   swift run strata-example PACK 1,2,3,4,5 16 42 0.8 40 0.95
import PackageDescription
import Foundation

// The repository root, from this file's path: bindings/swift/Package.swift.
let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
    .deletingLastPathComponent().deletingLastPathComponent()
let libDir = root.appendingPathComponent("target/release").path

let package = Package(
    name: "Strata",
    products: [
        .library(name: "Strata", targets: ["Strata"]),
        .executable(name: "strata-example", targets: ["strata-example"]),
    ],
    targets: [
        // module.modulemap: `module CStrata [system] { header "shim.h" link "strata" }`.
        .systemLibrary(name: "CStrata", path: "Sources/CStrata"),
        .target(
            name: "Strata",
            dependencies: ["CStrata"],
            linkerSettings: [
                // Where libstrata.so is, and an rpath so that it runs in place.
                .unsafeFlags(["-L", libDir, "-Xlinker", "-rpath", "-Xlinker", libDir]),
            ]
        ),
        .executableTarget(name: "strata-example", dependencies: ["Strata"]),
    ]
)
